"""What the engine hands back, in vLLM's shape: a RequestOutput per request, holding a
CompletionOutput per generated sequence."""

from dataclasses import dataclass


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None  # per generated token: {token id: logprob}
    finish_reason: str | None  # "length" | "stop" | "abort" | None while running
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # with SamplingParams.prompt_logprobs: None, then per prompt token {token id: logprob}
    # (the token's own and the top k), once the prefill is done (prompt_logprobs.py)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # beside it: each prompt token's rank in its distribution (1 = the most likely)
    prompt_token_ranks: list[int | None] | None = None
