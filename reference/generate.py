"""Generate one sequence token by token, with or without a KV cache.

Each step runs the model on the tokens whose K/V are not stored yet, takes the last position's
logits and picks the next token. With no cache that is the whole sequence, every step (the work
grows with the square of the length); with a cache it is the prompt once (prefill), then one
token per step (decode). Both must pick identical tokens: the cache changes the cost, never the
result.
"""

import torch

from .cache import ContiguousCache, NoCache

CACHE_KINDS = ("contiguous", "none")


def check_prompt(prompt_ids, vocab_size: int) -> list[int]:
    """A non-empty list of token ids inside the vocabulary, or a ValueError saying what is wrong."""
    ids = [int(t) for t in prompt_ids]
    if not ids:
        raise ValueError("the prompt is empty; give at least one token")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the vocabulary; "
                         f"valid ids are 0..{vocab_size - 1}")
    return ids


def make_cache(model, kind: str, max_len: int):
    cfg = model.config
    if kind == "none":
        return NoCache()
    if kind == "contiguous":
        param = next(model.parameters())
        return ContiguousCache(cfg.num_layers, max_len, cfg.num_kv_heads, cfg.head_dim,
                               dtype=param.dtype, device=param.device)
    raise ValueError(f"cache {kind!r} is unknown; choose one of {CACHE_KINDS}")


def sample_next(logits: torch.Tensor, temperature: float,
                generator: torch.Generator | None = None) -> int:
    """Greedy at temperature 0; otherwise a draw from softmax(logits / temperature).

    The draw is the "exponential race": argmax of p / E with E ~ Exp(1), which picks token i with
    probability p_i and lets a seeded generator fix the outcome exactly.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    if temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # [vocab]
    race = torch.empty_like(probs).exponential_(generator=generator)  # [vocab]
    return int(torch.argmax(probs / race))


# --8<-- [start:generate]
@torch.inference_mode()
def generate(model, prompt_ids, max_new_tokens: int = 32, *, temperature: float = 0.0,
             cache: str = "contiguous", eos_token_id: int | None = None,
             generator: torch.Generator | None = None) -> list[int]:
    """The new token ids (at most max_new_tokens; fewer when eos_token_id is produced)."""
    cfg = model.config
    tokens = check_prompt(prompt_ids, cfg.vocab_size)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    max_len = len(tokens) + max_new_tokens
    if max_len > cfg.max_position_embeddings:
        raise ValueError(f"prompt ({len(tokens)}) + max_new_tokens ({max_new_tokens}) = {max_len} "
                         f"exceeds the model's {cfg.max_position_embeddings} positions")
    kv = make_cache(model, cache, max_len)
    device = next(model.parameters()).device
    prompt_len = len(tokens)
    for _ in range(max_new_tokens):
        start = kv.num_cached_tokens  # 0 without a cache: feed everything again
        new_ids = torch.tensor(tokens[start:], device=device)  # [T]
        positions = torch.arange(start, len(tokens), device=device)  # [T]
        logits = model(new_ids, positions, kv, last_only=True)[0]  # [vocab]
        tokens.append(sample_next(logits, temperature, generator))
        if tokens[-1] == eos_token_id:
            break
    return tokens[prompt_len:]
# --8<-- [end:generate]
