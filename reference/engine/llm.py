"""LLM: the offline entry point, vLLM's shape. Load a checkpoint folder, size the KV pool, and
generate for a list of prompts with continuous batching underneath."""

import inspect
from dataclasses import MISSING, fields, replace
from pathlib import Path

from tqdm import tqdm

from .beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from .chat import chat_prompt
from .config import EngineArgs
from .engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams


class LLM:
    """Generate for a list of prompts; the engine steps underneath.

    ``LLM(model, **options)``: options are the fields of ``EngineArgs`` (config.py: dtype,
    device, block_size, num_gpu_blocks, kv_cache_memory, swap_space_blocks, kv_layout,
    reservation_policy, batching, max_num_seqs, max_num_batched_tokens, max_model_len,
    preemption_mode, enable_prefix_caching, enable_chunked_prefill, seed, backend,
    max_logprobs, ...), checked before the weights load. ``LLM(engine_args)`` takes a whole
    EngineArgs instead — how a tier's LLM (``pagedllm.optimized.LLM``) hands in its own model
    runner.
    """

    def __init__(self, model: str | Path | EngineArgs, *args, **options):
        if isinstance(model, EngineArgs):
            if args or options:
                raise TypeError("LLM(engine_args) takes no other options")
            engine_args = model
        else:  # positional options in EngineArgs' order: dtype, device, block_size, ...
            engine_args = EngineArgs(model, *args, **options)
        self.engine = LLMEngine.from_engine_args(engine_args)
        self.model_dir = self.engine.config.model_dir
        self.tokenizer = self.engine.tokenizer
        self._request_counter = 0

    def generate(self, prompts, sampling_params: SamplingParams | list | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Outputs in the order of the prompts. Strings, token-id lists or
        {"prompt_token_ids": [...]} dicts; one SamplingParams for all or one per prompt."""
        prompts = _prompt_list(prompts)
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        # Only finished outputs are returned here, so the engine need not build the others
        # (vLLM's LLM does the same with RequestOutputKind.FINAL_ONLY).
        params = [replace(p, output_kind="final_only") if isinstance(p, SamplingParams) else p
                  for p in params]
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
                if self.engine.has_request(request_id):
                    self.engine.abort_request(request_id)
            raise
        return [finished[i] for i in ids]

    def stats(self) -> dict:
        return self.engine.stats()

    def kernels(self) -> dict[str, str]:
        """What computes each op of a step on this machine, and why: the backend the runner
        chose (or was handed), op by op. ``pagedllm env`` prints the same."""
        return self.engine.runner.kernels()

    def shutdown(self) -> None:
        """End what the engine started (a tensor-parallel engine's worker ranks); also at exit,
        or at the end of ``with LLM(...) as llm:``."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


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


def signature_of(args_class) -> inspect.Signature:
    """LLM's options as help() and editors show them: the fields of args_class, in order."""
    return inspect.Signature(
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        + [inspect.Parameter(f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                             default=(inspect.Parameter.empty if f.default is MISSING
                                      else f.default), annotation=f.type)
           for f in fields(args_class)])


LLM.__init__.__signature__ = signature_of(EngineArgs)
