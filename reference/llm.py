"""LLM: the offline entry point, vLLM's shape. Load a checkpoint folder, size the KV pool, and
generate for a list of prompts with continuous batching underneath."""

from pathlib import Path

from tqdm import tqdm

from .beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from .cache_engine import PagedKVCache
from .config import load_config
from .engine import LLMEngine
from .kv_size import kv_size
from .model import load_model
from .outputs import RequestOutput
from .sampling_params import SamplingParams
from .scheduler import SchedulerConfig

DEFAULT_KV_CACHE_MEMORY = 256 * 2**20  # bytes, when neither num_gpu_blocks nor memory is given


class LLM:
    def __init__(self, model: str | Path, dtype: str = "float32", device: str = "cpu",
                 block_size: int = 16, num_gpu_blocks: int | None = None,
                 kv_cache_memory: int | None = None, swap_space_blocks: int = 0,
                 kv_layout: str = "paged", reservation_policy: str = "max",
                 batching: str = "continuous", max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None, max_model_len: int | None = None,
                 preemption_mode: str = "recompute", enable_prefix_caching: bool = False,
                 enable_chunked_prefill: bool = False, seed: int = 0):
        cfg = load_config(model)
        max_model_len = max_model_len or cfg.max_position_embeddings
        if max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's "
                             f"{cfg.max_position_embeddings} positions")
        if num_gpu_blocks is None:  # as many blocks as the KV memory budget buys
            per_token = kv_size(model, dtype).bytes_per_token
            num_gpu_blocks = (kv_cache_memory or DEFAULT_KV_CACHE_MEMORY) // (
                per_token * block_size)
        self.model_dir = Path(model)
        self.tokenizer = _load_tokenizer(self.model_dir)
        if max_num_batched_tokens is None:  # vLLM's default: a whole prompt fits one step
            max_num_batched_tokens = 2048 if enable_chunked_prefill else max(2048, max_model_len)
        scheduler_config = SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, preemption_mode=preemption_mode,
            enable_chunked_prefill=enable_chunked_prefill, batching=batching)
        self.engine = LLMEngine(load_model(model, dtype=dtype, device=device), self.tokenizer,
                                block_size=block_size, num_gpu_blocks=num_gpu_blocks,
                                swap_space_blocks=swap_space_blocks, kv_layout=kv_layout,
                                reservation_policy=reservation_policy,
                                scheduler_config=scheduler_config,
                                enable_prefix_caching=enable_prefix_caching, seed=seed)
        self._request_counter = 0

    def generate(self, prompts, sampling_params: SamplingParams | list | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Outputs in the order of the prompts. Strings, token-id lists or
        {"prompt_token_ids": [...]} dicts; one SamplingParams for all or one per prompt."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        ids = []
        for prompt, p in zip(prompts, params, strict=True):
            request_id = str(self._request_counter)
            self._request_counter += 1
            try:
                self.engine.add_request(request_id, prompt, p)
            except ValueError:
                for queued in ids:  # refuse the whole call; leave the engine as it was
                    self.engine.abort_request(queued)
                raise
            ids.append(request_id)
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        return [finished[i] for i in ids]

    def beam_search(self, prompts, params: BeamSearchParams) -> list[BeamSearchOutput]:
        """The beam_width best continuations of each prompt, best first (one prompt at a time;
        beams share blocks through fork and copy-on-write)."""
        engine = self.engine
        if not isinstance(engine.kv, PagedKVCache):
            raise ValueError("beam search shares blocks between beams: it needs "
                             "kv_layout='paged'")
        if engine.has_unfinished_requests():
            raise ValueError("beam_search runs on an idle engine; finish or abort the running "
                             "requests first")
        prompts = [prompts] if isinstance(prompts, str | dict) else prompts
        results = []
        for prompt in prompts:
            _, ids = engine._prompt_ids(prompt)
            manager = engine.kv.manager
            # the prompt once, plus every beam's own blocks for its tokens and one spare
            need = manager.blocks_needed(len(ids)) + params.beam_width * (
                manager.blocks_needed(params.max_tokens) + 1)
            if need > manager.num_free_gpu_blocks:
                raise ValueError(f"beam_width {params.beam_width} x max_tokens "
                                 f"{params.max_tokens} needs up to {need} KV blocks; the pool "
                                 f"has {manager.num_free_gpu_blocks} free")
            out = beam_search(engine, ids, params)
            if self.tokenizer is not None:
                for seq in out.sequences:
                    seq.text = self.tokenizer.decode(seq.tokens, skip_special_tokens=True)
            results.append(out)
        return results

    def stats(self) -> dict:
        return self.engine.stats()


def _load_tokenizer(model_dir: Path):
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
