"""The engine's door: a request is checked here before it is queued, or refused.

An accepted request always finishes, so everything that could stop it from finishing is refused
now, with a ValueError naming the field (``FieldValueError.field``: a server answers 400 for that
field without reading the message): a prompt that is empty, outside the vocabulary or longer
than max_model_len; more sequences or tokens per step than the budgets allow; more KV memory
than the whole pool holds (it could never finish); logprobs, prompt_logprobs, stop tokens or
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
                  sc: SchedulerConfig, vocab_size: int) -> None:
    """Refuse what the scheduler could never run, the KV pool never hold, or the sampler never
    serve. kv: the engine's KV cache manager (it knows what its layout can hold)."""
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
        if params.logprobs is not None and params.logprobs > vocab_size:
            raise FieldValueError("logprobs", f"logprobs = {params.logprobs} is more than the "
                                  f"vocabulary of {vocab_size} tokens")
        if params.prompt_logprobs is not None and params.prompt_logprobs > vocab_size:
            raise FieldValueError("prompt_logprobs", f"prompt_logprobs = "
                                  f"{params.prompt_logprobs} is more than the vocabulary of "
                                  f"{vocab_size} tokens")
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
        never = kv.never_fits(most, copies=width)
    if never:
        amount = f"{width} x {most} tokens" if width > 1 else f"{most} tokens"
        raise FieldValueError("max_tokens", f"request {request_id!r} needs up to {amount} of KV "
                              "memory, more than the whole KV pool holds: it could never "
                              "finish; lower n (or beam_width) or max_tokens, or give the pool "
                              "more blocks")
# --8<-- [end:check_request]
