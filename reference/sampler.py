"""From next-token logits to a token, and the checks that end a sequence.

Sampling order: block EOS and stop tokens while min_tokens is not reached; greedy when
temperature is 0; otherwise divide by the temperature, keep the top_k tokens, keep the smallest
set whose probability reaches top_p, renormalise and draw. The draw is the exponential race —
argmax of p / E with E ~ Exp(1) drawn from the request's own torch.Generator — which picks token
i with probability p_i and consumes exactly one draw per vocabulary entry per step, so a seeded
request gives the same tokens whatever else runs beside it, in either tier.

Logprobs are those of the model's distribution (log_softmax of the raw logits), as vLLM reports
them by default.
"""

import torch

from .sampling_params import SamplingParams


# --8<-- [start:sample]
def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator,
           num_generated: int, eos_token_id: int | None) -> tuple[int, float, dict[int, float]]:
    """logits [vocab] -> (token, its logprob, top-`params.logprobs` {token: logprob})."""
    logits = logits.float().cpu()  # drawn on the CPU: a request's generator lives there
    logprobs = torch.log_softmax(logits, dim=-1)  # [vocab], reported as is
    if num_generated < params.min_tokens:  # too early to stop: EOS and stop tokens are out
        blocked = list(params.stop_token_ids)
        if eos_token_id is not None and not params.ignore_eos:
            blocked.append(eos_token_id)
        logits = logits.clone()
        logits[blocked] = float("-inf")
    if params.temperature == 0:
        token = int(torch.argmax(logits))
    else:
        scaled = logits / params.temperature
        if params.top_k > 0:  # everything below the k-th largest logit is out
            kth = torch.topk(scaled, min(params.top_k, scaled.numel())).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)  # [vocab]
        if params.top_p < 1:  # the smallest head of the sorted distribution reaching top_p
            sorted_probs, order = torch.sort(probs, descending=True)
            before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass ahead of each
            drop = torch.zeros_like(probs, dtype=torch.bool)
            drop[order[before >= params.top_p]] = True
            probs = probs.masked_fill(drop, 0.0)
            probs = probs / probs.sum()
        race = torch.empty_like(probs).exponential_(generator=generator)  # E ~ Exp(1)
        token = int(torch.argmax(probs / race))
    top = {}
    if params.logprobs:
        values, ids = torch.topk(logprobs, params.logprobs)
        top = dict(zip(ids.tolist(), values.tolist(), strict=True))
    return token, float(logprobs[token]), top
# --8<-- [end:sample]


def check_stop(token_ids: list[int], num_generated: int, text: str, params: SamplingParams,
               eos_token_id: int | None, max_model_len: int,
               prompt_len: int) -> tuple[str | None, int | str | None, str]:
    """(finish_reason, stop_reason, text to keep) after a token was appended; reason None if
    the sequence goes on. A stop string ends the text just before it."""
    token = token_ids[-1]
    if num_generated >= params.min_tokens:
        if token == eos_token_id and not params.ignore_eos:
            return "stop", None, text
        if token in params.stop_token_ids:
            return "stop", token, text
        for stop in params.stop_strings:
            at = text.find(stop)
            if at != -1:
                return "stop", stop, text[:at]
    if num_generated >= params.max_tokens or prompt_len + num_generated >= max_model_len:
        return "length", None, text
    return None, None, text
