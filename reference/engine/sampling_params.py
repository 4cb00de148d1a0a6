"""What a request asks for: how to pick tokens and when to stop. vLLM's SamplingParams, checked
when it is made, so a bad value is refused before it reaches the engine."""

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    n: int = 1  # samples per prompt (parallel sampling)
    temperature: float = 1.0  # 0 is greedy
    top_k: int = -1  # keep the k most likely tokens; -1 keeps all
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    seed: int | None = None  # sample i draws from its own generator seeded seed + i
    max_tokens: int = 16
    min_tokens: int = 0  # EOS and stop tokens are blocked until this many tokens exist
    stop: list[str] | str | None = None  # stop strings; not included in the output text
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # return the top-k logprobs of every generated token
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (all tokens) or >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens = {self.max_tokens}], "
                             f"got {self.min_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0 or None, got {self.logprobs}")
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in self.stop_strings):
            raise ValueError("stop strings must be non-empty")
        self.stop_token_ids = list(self.stop_token_ids or [])
