"""What a request asks for: how to pick tokens and when to stop. vLLM's SamplingParams, checked
when it is made, so a bad value is refused before it reaches the engine."""

from dataclasses import dataclass, field

from ..ops.sampling import FLOAT32_MAX

# The params module, a leaf: the package also reaches grammar.py, which imports the sequence,
# which imports this module (an import circle).
from .structured_outputs.params import StructuredOutputsParams
from .validation import (
    FieldTypeError,
    FieldValueError,
    check_bool,
    check_choice,
    check_float,
    check_int,
)

OUTPUT_KINDS = ("cumulative", "final_only")  # vLLM's RequestOutputKind (DELTA aside)


# --8<-- [start:params]
@dataclass
class SamplingParams:
    n: int = 1  # samples per prompt (parallel sampling)
    temperature: float = 1.0  # 0 (or below 1e-5) is greedy
    top_k: int = -1  # keep the k most likely tokens; -1 keeps all
    # keep the smallest set of tokens whose probability reaches top_p
    top_p: float = 1.0
    seed: int | None = None  # sample i draws from its own generator seeded seed + i
    max_tokens: int = 16
    min_tokens: int = 0  # EOS and stop tokens are blocked until this many tokens exist
    stop: list[str] | str | None = None  # stop strings; not included in the output text
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # return the top-k logprobs of every generated token
    prompt_logprobs: int | None = None  # every prompt token's logprob and the top k
    # "cumulative": every step that touches the request returns its output so far
    # (streaming); "final_only": only the finished output (LLM.generate) — then nobody
    # reads the text before the end, and it is decoded once, at the end, unless stop
    # strings need it earlier.
    output_kind: str = "cumulative"
    # Logit transforms, vLLM's names and ranges: seen tokens' logits divided (positive)
    # or multiplied (negative) by repetition_penalty (prompt and output, 1 is off);
    # frequency_penalty per time, presence_penalty once, per generated token (OpenAI's)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    # a JSON schema, regex, choice or grammar every output must follow (xgrammar)
    structured_outputs: StructuredOutputsParams | None = None
    stop_strings: list[str] = field(init=False, repr=False)
    # --8<-- [end:params]

    def __post_init__(self):
        check_int("n", self.n, low=1)
        # Below 1e-5 it is greedy; above float32's largest value the sampler's division would
        # turn a blocked token's -inf into NaN.
        check_float("temperature", self.temperature, 0.0)
        if self.temperature > FLOAT32_MAX:
            raise FieldValueError("temperature", f"temperature must be at most "
                                  f"{FLOAT32_MAX:.6g} (float32's "
                                  f"largest number), got {self.temperature}")
        check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        check_int("top_k", self.top_k, low=1, allowed=(-1,))
        if self.seed is not None:
            check_int("seed", self.seed, low=0, high=2**64 - 1)
        check_int("max_tokens", self.max_tokens, low=1)
        check_int("min_tokens", self.min_tokens, low=0, high=self.max_tokens)
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, low=0)
        if self.prompt_logprobs is not None:
            check_int("prompt_logprobs", self.prompt_logprobs, low=0)
        check_bool("ignore_eos", self.ignore_eos)
        check_choice("output_kind", self.output_kind, OUTPUT_KINDS)
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise FieldValueError("stop", f"stop must be a non-empty string or a list of "
                                  f"them, got {self.stop!r}")
        self.stop_strings = stops
        if isinstance(self.stop_token_ids, str | bytes):
            raise FieldTypeError("stop_token_ids",
                                 "stop_token_ids must be a list of token ids, got a string")
        self.stop_token_ids = list(self.stop_token_ids or [])
        for token in self.stop_token_ids:
            check_int("stop_token_ids", token, low=0)
        # Above float32's largest value the factor would be inf in the sampler.
        check_float("repetition_penalty", self.repetition_penalty, 0.0, FLOAT32_MAX,
                    low_open=True)
        check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        check_float("min_p", self.min_p, 0.0, 1.0)
        self.logit_bias = check_logit_bias(self.logit_bias)
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            raise FieldTypeError("structured_outputs", "structured_outputs must be "
                                 "StructuredOutputsParams(json=... | regex=... | choice=... | "
                                 f"grammar=... | json_object=True), got "
                                 f"{type(self.structured_outputs).__name__}")


LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]


def check_logit_bias(logit_bias) -> dict[int, float]:
    """{token id: value} with ids >= 0 (the vocabulary is checked at the engine's door)
    and values in [-100, 100]; None is {}."""
    if logit_bias is None:
        return {}
    if not isinstance(logit_bias, dict):
        raise FieldTypeError("logit_bias", f"logit_bias must be a dict of token id -> "
                             f"value, got {type(logit_bias).__name__}")
    checked = {}
    for token, value in logit_bias.items():
        check_int("logit_bias", token, low=0)
        check_float("logit_bias", value, -LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT)
        checked[token] = float(value)
    return checked
