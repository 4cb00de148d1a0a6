"""``speculative_config``: vLLM's shape, checked before any weight loads.

    {"method": "ngram", "num_speculative_tokens": k,
     "prompt_lookup_max": n, "prompt_lookup_min": m}
    {"model": PATH_OR_NAME, "num_speculative_tokens": k}     (method "draft_model")

A dict, its JSON text (the CLI's and the server's ``--speculative-config``) or a
SpeculativeConfig. Every key is checked by name (``speculative_config.<key>``); an unknown one
is refused, never ignored. What speculation cannot apply to is refused by the engine's config
checks (static batching, the contiguous layout, a draft whose vocabulary differs) and by
``add_request`` (beam search).
"""

import json
from dataclasses import dataclass
from pathlib import Path

from ..engine.validation import FieldTypeError, FieldValueError, check_int

FIELD = "speculative_config"
METHODS = ("ngram", "draft_model")
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model")
# n-gram lengths when none is given: suffixes of 4 down to 2 tokens (a single repeated token
# proposes too often on free text for its proposals to pay).
DEFAULT_LOOKUP_MAX, DEFAULT_LOOKUP_MIN = 4, 2


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram" | "draft_model"
    num_speculative_tokens: int
    prompt_lookup_max: int = DEFAULT_LOOKUP_MAX  # ngram only
    prompt_lookup_min: int = DEFAULT_LOOKUP_MIN
    model: str | None = None  # draft_model: as given (a folder, a GGUF or a registry name)
    draft_model_dir: Path | None = None  # resolved by the engine's config checks


def check_speculative_config(raw) -> SpeculativeConfig | None:
    """None (no speculation), a dict, JSON text or a SpeculativeConfig -> a checked config."""
    if raw is None or isinstance(raw, SpeculativeConfig):
        return raw
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as err:
            raise FieldValueError(FIELD, f"{FIELD} is not valid JSON ({err.msg} at column "
                                  f"{err.colno}); e.g. '{{\"method\": \"ngram\", "
                                  f"\"num_speculative_tokens\": 4}}'") from None
    if not isinstance(raw, dict):
        raise FieldTypeError(FIELD, f"{FIELD} must be a dict (or its JSON text) such as "
                             f"{{'method': 'ngram', 'num_speculative_tokens': 4}}, got {raw!r}")
    unknown = [key for key in raw if key not in KEYS]
    if unknown:
        raise FieldValueError(f"{FIELD}.{unknown[0]}", f"{FIELD}.{unknown[0]} is not an "
                              f"option of speculative decoding here; the keys are {KEYS}")
    method = raw.get("method", "draft_model" if raw.get("model") is not None else None)
    if method is None:
        raise FieldValueError(f"{FIELD}.method", f"{FIELD} needs a method: 'ngram' "
                              "(prompt lookup), or a draft model's 'model'")
    if method not in METHODS:
        raise FieldValueError(f"{FIELD}.method", f"{FIELD}.method {method!r} is not "
                              f"supported; choose one of {METHODS} (EAGLE, Medusa and MTP "
                              "heads are not implemented)")
    k = raw.get("num_speculative_tokens")
    if k is None:
        raise FieldValueError(f"{FIELD}.num_speculative_tokens", f"{FIELD} needs "
                              "num_speculative_tokens: how many tokens to propose a step")
    check_int(f"{FIELD}.num_speculative_tokens", k, low=1, high=64)
    if method == "ngram":
        if raw.get("model") is not None:
            raise FieldValueError(f"{FIELD}.model", f"{FIELD}.model names a draft model; "
                                  "method 'ngram' proposes from the sequence itself and takes "
                                  "none")
        lmax, lmin = raw.get("prompt_lookup_max"), raw.get("prompt_lookup_min")
        for name, value in (("prompt_lookup_max", lmax), ("prompt_lookup_min", lmin)):
            if value is not None:
                check_int(f"{FIELD}.{name}", value, low=1)
        if lmax is None:
            lmax = max(DEFAULT_LOOKUP_MAX, lmin or 0)
        if lmin is None:
            lmin = min(DEFAULT_LOOKUP_MIN, lmax)
        if lmin > lmax:
            raise FieldValueError(f"{FIELD}.prompt_lookup_min", f"{FIELD}.prompt_lookup_min "
                                  f"({lmin}) must be <= prompt_lookup_max ({lmax})")
        return SpeculativeConfig("ngram", k, lmax, lmin)
    for key in ("prompt_lookup_max", "prompt_lookup_min"):
        if raw.get(key) is not None:
            raise FieldValueError(f"{FIELD}.{key}", f"{FIELD}.{key} is an option of method "
                                  "'ngram', not of a draft model")
    model = raw.get("model")
    if not isinstance(model, str | Path) or not str(model).strip():
        raise FieldValueError(f"{FIELD}.model", f"{FIELD}.model must name the draft model (a "
                              f"folder, a .gguf file or a registry name), got {model!r}")
    return SpeculativeConfig("draft_model", k, model=str(model))
