"""Generate one sequence token by token, with or without a KV cache.

Each step runs the model on the tokens whose K/V are not stored yet, takes the last position's
logits and picks the next token. With no cache that is the whole sequence, every step (the work
grows with the square of the length); with a cache it is the prompt once (prefill), then one
token per step (decode). Both must pick identical tokens: the cache changes the cost, never the
result.
"""

import torch

from ..kv import BlockSpaceManager, CacheEngine, ContiguousAllocator
from ..model import AttentionMetadata, ContiguousCache, NoCache, PagedAttention
from ..model.latent_cache import ContiguousLatentCache
from ..ops import SamplingMetadata, sample
from ..ops.sampling import SamplingRow
from .request_checks import check_prompt

CACHE_KINDS = ("contiguous", "none")


def make_cache(model, kind: str, max_len: int):
    cfg = model.config
    if kind == "none":
        return NoCache()
    if kind == "contiguous":
        param = next(model.parameters())
        if cfg.is_mla:  # one latent row a token and layer, not K and V per head
            return ContiguousLatentCache.for_config(cfg, max_len, param.dtype, param.device)
        return ContiguousCache(cfg.num_layers, max_len, cfg.num_kv_heads, cfg.head_dim,
                               dtype=param.dtype, device=param.device)
    raise ValueError(f"cache {kind!r} is unknown; choose one of {CACHE_KINDS}")


def sample_next(logits: torch.Tensor, temperature: float, seed: int, position: int) -> int:
    """Greedy at temperature 0; otherwise a draw from softmax(logits / temperature), by the
    engine's sampler: the exponential race on counter-based random numbers keyed by (seed,
    position, token), so this loop and the engine draw the same tokens for the same seed."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    row = SamplingRow(temperature=temperature, stream=seed, position=position)
    metadata = SamplingMetadata.from_rows([row], logits.shape[-1], logits.device)
    return int(sample(logits[None], metadata).token_ids[0])


# --8<-- [start:generate]
@torch.inference_mode()
def generate(model, prompt_ids, max_new_tokens: int = 32, *, temperature: float = 0.0,
             cache: str = "contiguous", eos_token_id: int | None = None,
             seed: int = 0) -> list[int]:
    """The new token ids (at most max_new_tokens; fewer when eos_token_id is
    produced)."""
    cfg = model.config
    tokens = check_prompt(prompt_ids, cfg.vocab_size)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    max_len = len(tokens) + max_new_tokens
    if max_len > cfg.max_position_embeddings:
        raise ValueError(f"prompt ({len(tokens)}) + max_new_tokens ({max_new_tokens}) "
                         f"= {max_len} exceeds the model's "
                         f"{cfg.max_position_embeddings} positions")
    kv = make_cache(model, cache, max_len)
    device = next(model.parameters()).device
    prompt_len = len(tokens)
    for _ in range(max_new_tokens):
        start = kv.num_cached_tokens  # 0 without a cache: feed everything again
        new_ids = torch.tensor(tokens[start:], device=device)  # [T]
        positions = torch.arange(start, len(tokens), device=device)  # [T]
        last = torch.tensor([len(tokens) - start - 1], device=device)  # the newest row
        logits = model(new_ids, positions, kv, logits_indices=last)[0]  # [vocab]
        tokens.append(sample_next(logits, temperature, seed, len(tokens) - prompt_len))
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
    depend on where the blocks landed. (The engine batches these forwards into one step; here
    each sequence runs its own forward for clarity.)

    kv_layout: "per-sequence" (a ContiguousCache each), "paged" (one block pool, block_size
    tokens a block) or "slabs" (one linear space, a slab reserved per sequence under policy).
    """
    cfg = model.config
    tokens = [check_prompt(p, cfg.vocab_size) for p in prompts]
    param = next(model.parameters())
    if cfg.is_mla and kv_layout != "per-sequence":
        raise ValueError(f"kv_layout {kv_layout!r} builds per-head K/V blocks; a latent-"
                         "attention (MLA) model runs here with kv_layout='per-sequence', or "
                         "paged in the engine (LLM)")
    if kv_layout == "per-sequence":
        caches = [make_cache(model, "contiguous", len(t) + max_new_tokens) for t in tokens]
        prompt_lens = [len(t) for t in tokens]
        for _ in range(max_new_tokens):
            for seq, kv in zip(tokens, caches, strict=True):
                start = kv.num_cached_tokens
                ids = torch.tensor(seq[start:], device=param.device)  # [T]
                positions = torch.arange(start, len(seq), device=param.device)  # [T]
                last = torch.tensor([len(seq) - start - 1], device=param.device)
                seq.append(int(torch.argmax(model(ids, positions, kv, logits_indices=last)[0])))
        return [seq[n:] for seq, n in zip(tokens, prompt_lens, strict=True)]
    if kv_layout == "paged":
        manager = BlockSpaceManager(block_size, num_blocks or sum(
            -(-(len(t) + max_new_tokens) // block_size) for t in tokens))
        num_blocks = manager.gpu.num_blocks
        for seq_id, t in enumerate(tokens):
            manager.allocate(seq_id, len(t))  # the prompt's slots; decode slots come per step

        def table(seq_id: int, start: int, end: int) -> tuple[list[int], list[int]]:
            blocks = manager.tables[seq_id].blocks  # block table; slots of positions below
            return blocks, [manager.slot(seq_id, p) for p in range(start, end)]
    elif kv_layout == "slabs":
        # room for every sequence's largest possible slab: admission never has to wait here
        max_len = cfg.max_position_embeddings
        slabs = ContiguousAllocator(len(tokens) * max_len, policy, max_len)
        starts = [slabs.allocate(seq_id, len(t), max_new_tokens)  # position p -> start + p
                  for seq_id, t in enumerate(tokens)]
        block_size, num_blocks = 1, slabs.total_slots  # a slab: a run of one-token blocks

        def table(seq_id: int, start: int, end: int) -> tuple[list[int], list[int]]:
            first = starts[seq_id]
            return list(range(first, first + end)), list(range(first + start, first + end))
    else:
        raise ValueError(f"kv_layout {kv_layout!r} is unknown; choose one of {KV_LAYOUTS}")
    cache = CacheEngine(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, num_blocks,
                        dtype=param.dtype, device=param.device)

    prompt_lens = [len(t) for t in tokens]
    computed = [0] * len(tokens)  # tokens of each sequence whose K/V are stored
    for step in range(max_new_tokens):
        for seq_id, seq in enumerate(tokens):
            if kv_layout == "paged" and step > 0:
                _, copy = manager.append_slot(seq_id)  # a slot for the token fed this step
                cache.apply([], [], [copy] if copy else [])
            start, end = computed[seq_id], len(seq)
            blocks, slots = table(seq_id, start, end)
            seq_lens = torch.tensor([end], dtype=torch.int32)
            query_start_loc = torch.tensor([0, end - start], dtype=torch.int32)
            metadata = AttentionMetadata(
                slot_mapping=torch.tensor(slots, device=param.device),
                block_tables=torch.tensor([blocks], dtype=torch.int32, device=param.device),
                seq_lens=seq_lens.to(param.device), seq_lens_cpu=seq_lens,
                query_start_loc=query_start_loc.to(param.device),
                query_start_loc_cpu=query_start_loc)
            attn = PagedAttention(metadata, cache.gpu_k, cache.gpu_v)
            ids = torch.tensor(seq[start:], device=param.device)  # [T]
            positions = torch.arange(start, end, device=param.device)  # [T]
            last = torch.tensor([end - start - 1], device=param.device)
            seq.append(int(torch.argmax(model(ids, positions, attn, logits_indices=last)[0])))
            computed[seq_id] = end
    if kv_layout == "paged":
        for seq_id in range(len(tokens)):
            manager.free(seq_id)
    return [seq[n:] for seq, n in zip(tokens, prompt_lens, strict=True)]
# --8<-- [end:generate_many]
