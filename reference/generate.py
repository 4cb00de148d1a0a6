"""Generate one sequence token by token, with or without a KV cache.

Each step runs the model on the tokens whose K/V are not stored yet, takes the last position's
logits and picks the next token. With no cache that is the whole sequence, every step (the work
grows with the square of the length); with a cache it is the prompt once (prefill), then one
token per step (decode). Both must pick identical tokens: the cache changes the cost, never the
result.
"""

import torch

from .block_manager import BlockSpaceManager
from .cache import ContiguousCache, NoCache
from .contiguous_allocator import ContiguousAllocator
from .kv_storage import KVStorage, SequenceKV
from .paged_attention import gather_kv

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
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)  # [vocab], on the CPU
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
        logits = model(new_ids, positions, kv, logits_rows=[-1])[0]  # [vocab]
        tokens.append(sample_next(logits, temperature, generator))
        if tokens[-1] == eos_token_id:
            break
    return tokens[prompt_len:]
# --8<-- [end:generate]


KV_LAYOUTS = ("per-sequence", "paged", "slabs")


# --8<-- [start:generate_many]
@torch.inference_mode()
def generate_many(model, prompts: list[list[int]], max_new_tokens: int, *,
                  kv_layout: str = "paged", block_size: int = 16,
                  num_blocks: int | None = None, policy: str = "max") -> list[list[int]]:
    """Greedy-decode several prompts in lockstep over one shared KV memory.

    Each step every sequence gets one token, so with a paged layout their blocks interleave in
    the pool: sequence 0's second block lands after sequence 1's first. The tokens must not
    depend on where the blocks landed. (The engine of a later issue batches these forwards; here
    each sequence runs its own forward for clarity.)

    kv_layout: "per-sequence" (a ContiguousCache each), "paged" (one block pool, block_size
    tokens a block) or "slabs" (one linear space, a slab reserved per sequence under policy).
    """
    cfg = model.config
    tokens = [check_prompt(p, cfg.vocab_size) for p in prompts]
    param = next(model.parameters())
    if kv_layout == "per-sequence":
        caches = [make_cache(model, "contiguous", len(t) + max_new_tokens) for t in tokens]
    elif kv_layout == "paged":
        manager = BlockSpaceManager(block_size, num_blocks or sum(
            -(-(len(t) + max_new_tokens) // block_size) for t in tokens))
        storage = KVStorage(cfg.num_layers, manager.gpu.num_blocks * block_size,
                            cfg.num_kv_heads, cfg.head_dim, block_size, param.dtype,
                            param.device)
        caches = []
        for seq_id, t in enumerate(tokens):
            manager.allocate(seq_id, len(t))  # the prompt's slots; decode slots come per step
            caches.append(SequenceKV(
                storage, slots_of=lambda pos, s=seq_id: manager.slot_mapping(s, pos),
                read=lambda layer, n, s=seq_id: (  # gather whole blocks, as paged attention does
                    gather_kv(storage.k[layer], manager.tables[s].blocks, n),
                    gather_kv(storage.v[layer], manager.tables[s].blocks, n))))
    elif kv_layout == "slabs":
        # room for every sequence's largest possible slab: admission never has to wait here
        max_len = cfg.max_position_embeddings
        slabs = ContiguousAllocator(len(tokens) * max_len, policy, max_len)
        storage = KVStorage(cfg.num_layers, slabs.total_slots, cfg.num_kv_heads, cfg.head_dim,
                            dtype=param.dtype, device=param.device)
        caches = []
        for seq_id, t in enumerate(tokens):
            start = slabs.allocate(seq_id, len(t), max_new_tokens)  # position p -> start + p
            caches.append(SequenceKV(storage, lambda pos, s=start: [s + p for p in pos]))
    else:
        raise ValueError(f"kv_layout {kv_layout!r} is unknown; choose one of {KV_LAYOUTS}")

    prompt_lens = [len(t) for t in tokens]
    for step in range(max_new_tokens):
        for seq_id, (seq, kv) in enumerate(zip(tokens, caches, strict=True)):
            if kv_layout == "paged" and step > 0:
                _, copy = manager.append_slot(seq_id)  # a slot for the token fed this step
                storage.copy_blocks([copy] if copy else [])
            start = kv.num_cached_tokens
            ids = torch.tensor(seq[start:], device=param.device)
            positions = torch.arange(start, len(seq), device=param.device)
            seq.append(int(torch.argmax(model(ids, positions, kv, logits_rows=[-1])[0])))
    if kv_layout == "paged":
        for seq_id in range(len(tokens)):
            manager.free(seq_id)
    return [seq[n:] for seq, n in zip(tokens, prompt_lens, strict=True)]
# --8<-- [end:generate_many]
