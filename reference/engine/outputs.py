"""What the engine hands back, in vLLM's shape: a RequestOutput per request, holding a
CompletionOutput per generated sequence; and what a step's forward hands the scheduler
(ModelRunnerOutput, vLLM's name)."""

from dataclasses import dataclass, field

import torch

from ..ops import SamplerOutput


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


@dataclass
class ModelRunnerOutput:
    """What a step's forward and sampler gave, for ``Scheduler.update_from_output``."""

    sampled: SamplerOutput  # one token per sampling row
    logits: torch.Tensor  # [S (+ P prompt rows), vocab]: the sampling rows', then prompts'
    rows: list  # step_inputs.LogitsRow per sampling row: which sequence and sample it is for
    prompt_rows: list = field(default_factory=list)  # prompt_logprobs.PromptLogprobRows

    @property
    def prompt_logits(self) -> torch.Tensor:
        return self.logits[len(self.rows):]  # [P, vocab]
