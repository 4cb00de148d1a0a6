"""LLM: the offline entry point, vLLM's shape. Load a checkpoint folder, size the KV pool, and
generate for a list of prompts with continuous batching underneath."""

from pathlib import Path

import torch
from tqdm import tqdm

from ..kv_size import kv_size
from ..model import load_config, load_model, resolve_model
from ..model.registry import FLOAT_DTYPES
from ..ops import REFERENCE_BACKEND, Backend
from .beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from .chat import chat_prompt
from .engine import LLMEngine, check_backend
from .outputs import RequestOutput
from .sampling_params import SamplingParams
from .scheduler import SchedulerConfig
from .validation import check_int

DEFAULT_KV_CACHE_MEMORY = 256 * 2**20  # bytes, when neither num_gpu_blocks nor memory is given


class LLM:
    """Generate for a list of prompts; the engine steps underneath.

    A faster tier subclasses this and names its engine in ``engine_class``: the checks, the
    KV sizing, the tokenizer and the request loop below are the same for every tier.
    """

    engine_class = LLMEngine

    def __init__(self, model: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu",
                 block_size: int = 16, num_gpu_blocks: int | None = None,
                 kv_cache_memory: int | None = None, swap_space_blocks: int = 0,
                 kv_layout: str = "paged", reservation_policy: str = "max",
                 batching: str = "continuous", max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None, max_model_len: int | None = None,
                 preemption_mode: str = "recompute", enable_prefix_caching: bool = False,
                 enable_chunked_prefill: bool = False, seed: int = 0,
                 backend: Backend = REFERENCE_BACKEND):
        if isinstance(dtype, torch.dtype):  # vLLM takes torch.float16 as well as "float16"
            dtype = str(dtype).removeprefix("torch.")
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; choose one of "
                             f"{tuple(FLOAT_DTYPES)}")
        # The engine checks these again; here too, so that a typo fails before the weights load.
        check_int("seed", seed, low=0, high=2**64 - 1)
        check_backend(backend)
        model = resolve_model(model, dtype)  # a name or a GGUF file -> a checkpoint folder
        cfg = load_config(model)
        check_int("block_size", block_size, low=1)
        check_int("swap_space_blocks", swap_space_blocks, low=0)
        if max_model_len is None:
            max_model_len = cfg.max_position_embeddings
        check_int("max_model_len", max_model_len, low=1)
        if max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's "
                             f"{cfg.max_position_embeddings} positions")
        if num_gpu_blocks is None:  # as many blocks as the KV memory budget buys
            if kv_cache_memory is not None:
                check_int("kv_cache_memory", kv_cache_memory, low=1)
            per_token = kv_size(model, dtype).bytes_per_token
            num_gpu_blocks = (kv_cache_memory or DEFAULT_KV_CACHE_MEMORY) // (
                per_token * block_size)
            if num_gpu_blocks < 1:
                raise ValueError(f"kv_cache_memory = {kv_cache_memory} bytes holds no block of "
                                 f"{block_size} tokens ({per_token * block_size} bytes)")
        self.model_dir = Path(model)
        self.tokenizer = _load_tokenizer(self.model_dir)
        if max_num_batched_tokens is None:  # vLLM's default: a whole prompt fits one step
            max_num_batched_tokens = 2048 if enable_chunked_prefill else max(2048, max_model_len)
        scheduler_config = SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, preemption_mode=preemption_mode,
            enable_chunked_prefill=enable_chunked_prefill, batching=batching)
        self.engine = self.engine_class(
            load_model(model, dtype=dtype, device=device), self.tokenizer,
            block_size=block_size, num_gpu_blocks=num_gpu_blocks,
            swap_space_blocks=swap_space_blocks, kv_layout=kv_layout,
            reservation_policy=reservation_policy, scheduler_config=scheduler_config,
            enable_prefix_caching=enable_prefix_caching, seed=seed, backend=backend,
            **self.engine_options())
        self._request_counter = 0

    def engine_options(self) -> dict:
        """Keyword arguments a tier's engine takes beyond the reference's (none here)."""
        return {}

    def generate(self, prompts, sampling_params: SamplingParams | list | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Outputs in the order of the prompts. Strings, token-id lists or
        {"prompt_token_ids": [...]} dicts; one SamplingParams for all or one per prompt."""
        prompts = _prompt_list(prompts)
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        return self._run(prompts, params, "generate", use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | list | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Answer a conversation, [{"role": "user", "content": "..."}, ...], or a list of
        conversations, through the checkpoint's chat template (vLLM's LLM.chat)."""
        conversations = messages if messages and isinstance(messages, list | tuple) and all(
            isinstance(m, list | tuple) for m in messages) else [messages]
        prompts = [chat_prompt(self.tokenizer, c, chat_template, add_generation_prompt)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def beam_search(self, prompts, params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """The beam_width best continuations of each prompt, best first. Beam searches run
        through the engine like any request: batched with others, preempted, swapped; beams
        share blocks through fork and copy-on-write."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
        prompts = _prompt_list(prompts)
        outs = self._run(prompts, [params] * len(prompts), "beam search", use_tqdm)
        return [BeamSearchOutput(out.prompt_token_ids, [
            BeamSearchSequence(c.token_ids, c.cumulative_logprob,
                               c.cumulative_logprob / len(c.token_ids) ** params.length_penalty,
                               c.text if self.tokenizer is not None else None,
                               finished=c.finish_reason == "stop")
            for c in out.outputs]) for out in outs]

    def _run(self, prompts: list, params: list, desc: str, use_tqdm: bool) -> list[RequestOutput]:
        """Add every request, step until all finish. On any exception (a refused request, an
        error inside a step, Ctrl-C) the requests of this call are aborted: the engine stays
        usable and holds none of their memory."""
        ids = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                request_id = str(self._request_counter)
                self._request_counter += 1
                self.engine.add_request(request_id, prompt, p)
                ids.append(request_id)
            finished: dict[str, RequestOutput] = {}
            with tqdm(total=len(ids), desc=desc, disable=not use_tqdm) as bar:
                while len(finished) < len(ids):
                    if not self.engine.has_unfinished_requests():
                        raise RuntimeError("the engine stopped with requests of this call "
                                           "unfinished; this is a bug, please report it")
                    for out in self.engine.step():
                        if out.finished and out.request_id in ids:
                            finished[out.request_id] = out
                            bar.update(1)
        except BaseException:
            for request_id in ids:
                if request_id in self.engine.groups:
                    self.engine.abort_request(request_id)
            raise
        return [finished[i] for i in ids]

    def stats(self) -> dict:
        return self.engine.stats()


def _prompt_list(prompts) -> list:
    """One prompt (text or a dict) or a list of prompts; a flat list of ints is ambiguous."""
    if isinstance(prompts, str | dict):
        return [prompts]
    if not isinstance(prompts, list | tuple):
        raise TypeError(f"prompts must be a prompt or a list of prompts, got "
                        f"{type(prompts).__name__}")
    if prompts and all(isinstance(p, int) for p in prompts):
        raise TypeError("prompts is a flat list of integers: pass token ids as "
                        "{'prompt_token_ids': [1, 2, 3]} (or a list of such dicts, or a list "
                        "of lists) so that one prompt is not read as many")
    return list(prompts)


def _load_tokenizer(model_dir: Path):
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
