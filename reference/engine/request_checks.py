"""The engine's door: a request is checked here before it is queued, or refused.

An accepted request always finishes, so everything that could stop it from finishing is refused
now, with a ValueError naming the field (``FieldValueError.field``: a server answers 400 for that
field without reading the message): a prompt that is empty, outside the vocabulary or longer
than max_model_len; more sequences or tokens per step than the budgets allow; more KV memory
than the whole pool holds (it could never finish); logprobs or prompt_logprobs above the
engine's max_logprobs (vLLM's cap, default 20); logprobs, prompt_logprobs, stop tokens or
logit_bias ids past the vocabulary.
"""

import torch

from .beam_search import BeamSearchParams
from .sampling_params import SamplingParams
from .scheduler import SchedulerConfig
from .validation import FieldTypeError, FieldValueError, check_token_ids


def check_params(params) -> None:
    if not isinstance(params, SamplingParams | BeamSearchParams):
        raise FieldTypeError("params", f"params must be SamplingParams or BeamSearchParams, got "
                             f"{type(params).__name__}")


def check_prompt(prompt_ids, vocab_size: int) -> list[int]:
    """A non-empty list of token ids inside the vocabulary, or a ValueError saying what is wrong."""
    if isinstance(prompt_ids, torch.Tensor):
        prompt_ids = prompt_ids.tolist()
    ids = check_token_ids("prompt", prompt_ids, vocab_size)
    if not ids:
        raise FieldValueError("prompt", "the prompt is empty; give at least one token")
    return ids


def prompt_ids(prompt, tokenizer, vocab_size: int) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a prompt given as text, token ids or a dict."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" not in prompt:
            raise FieldValueError("prompt", "a dict prompt needs 'prompt_token_ids'")
        text = prompt.get("prompt")  # optional: the text the ids came from
        if text is not None and not isinstance(text, str):
            raise FieldTypeError("prompt", f"a dict prompt's 'prompt' must be text, got "
                                 f"{type(text).__name__}")
        return text, check_prompt(prompt["prompt_token_ids"], vocab_size)
    if isinstance(prompt, str):
        if not prompt:
            raise FieldValueError("prompt", "the prompt is empty; give at least one token")
        if tokenizer is None:
            raise FieldValueError("prompt", "this model folder has no tokenizer: pass "
                                  "{'prompt_token_ids': [...]} instead of text")
        return prompt, check_prompt(tokenizer(prompt)["input_ids"], vocab_size)
    if not isinstance(prompt, list | tuple):
        raise FieldTypeError("prompt", f"a prompt is text, a list of token ids or "
                             f"{{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
    return None, check_prompt(prompt, vocab_size)


# --8<-- [start:check_request]
def check_request(request_id: str, num_prompt_tokens: int, params, kv,
                  sc: SchedulerConfig, vocab_size: int, max_logprobs: int) -> None:
    """Refuse what the scheduler could never run, the KV pool never hold, or the sampler never
    serve. kv: the engine's KV cache manager (it knows what its layout can hold);
    max_logprobs: the engine's cap on logprobs and prompt_logprobs (-1: the vocabulary)."""
    if num_prompt_tokens > sc.max_model_len:
        raise FieldValueError("prompt", f"prompt of {num_prompt_tokens} tokens is longer than "
                              f"max_model_len = {sc.max_model_len}")
    beam = isinstance(params, BeamSearchParams)
    width, field = (params.beam_width, "beam_width") if beam else (params.n, "n")
    if width > sc.max_num_seqs:
        raise FieldValueError(field, f"{field} = {width} runs {width} sequences at once, more "
                              f"than max_num_seqs = {sc.max_num_seqs}: lower {field} or raise "
                              "max_num_seqs")
    if width > sc.max_num_batched_tokens:
        raise FieldValueError(field, f"{field} = {width} decodes {width} tokens per step, more "
                              f"than max_num_batched_tokens = {sc.max_num_batched_tokens}")
    if not beam:
        for name in ("logprobs", "prompt_logprobs"):
            check_logprobs(name, getattr(params, name), vocab_size, max_logprobs)
        bad = [t for t in params.stop_token_ids if t >= vocab_size]
        if bad:
            raise FieldValueError("stop_token_ids", f"stop_token_ids {bad[:5]} are outside the "
                                  f"vocabulary; valid ids are 0..{vocab_size - 1}")
        bad = [t for t in params.logit_bias if t >= vocab_size]
        if bad:
            raise FieldValueError("logit_bias", f"logit_bias token ids {bad[:5]} are outside "
                                  f"the vocabulary; valid ids are 0..{vocab_size - 1}")
    if (beam or width > 1) and kv.layout != "paged":
        what = "beams" if beam else f"n = {width} parallel samples"
        raise FieldValueError(field, f"{what} share the prompt's blocks, which needs "
                              "kv_layout='paged'")
    most = min(num_prompt_tokens + params.max_tokens, sc.max_model_len)
    if beam:  # beams share the prompt; each may hold its own tokens and one spare block
        never = kv.never_fits_beams(num_prompt_tokens, most, width)
    else:  # at worst every sample holds its own copy of everything (after a recompute)
        never = kv.never_fits(most, copies=width, chunk_tokens=sc.max_num_batched_tokens
                              if sc.enable_chunked_prefill else None)
    if never:
        amount = f"{width} x {most} tokens" if width > 1 else f"{most} tokens"
        raise FieldValueError("max_tokens", f"request {request_id!r} needs up to {amount} of KV "
                              "memory, more than the whole KV pool holds: it could never "
                              "finish; lower n (or beam_width) or max_tokens, or give the pool "
                              "more blocks")
# --8<-- [end:check_request]


def check_logprobs(name: str, k: int | None, vocab_size: int, max_logprobs: int) -> None:
    """logprobs or prompt_logprobs: at most the vocabulary, and at most max_logprobs (vLLM's
    engine argument, default 20; -1: no cap). Without the cap one request could ask for the
    whole vocabulary at every prompt token: vocabulary x prompt tokens floats (SmolLM2: 49,152
    x 2,048, about 100 million), held until it finishes."""
    if k is None:
        return
    if k > vocab_size:
        raise FieldValueError(name, f"{name} = {k} is more than the vocabulary of {vocab_size} "
                              "tokens")
    if max_logprobs != -1 and k > max_logprobs:
        raise FieldValueError(name, f"{name} = {k} is more than max_logprobs = {max_logprobs}, "
                              f"the most logprobs a request may ask for: ask for at most "
                              f"{max_logprobs}, or raise the cap (LLM(..., max_logprobs=N), "
                              "pagedllm serve --max-logprobs N; -1 allows up to the whole "
                              "vocabulary)")
