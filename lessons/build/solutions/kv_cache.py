"""Solution of milestone 1: the paged KV pool, its writes, its reads and its block copies."""

import torch

from pagedllm.reference.ops import causal_attention


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                      head_dim: int, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu"
                      ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # One tensor per layer and kind: a list of one tensor repeated would be one pool for all.
    k_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
    v_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
    return k_caches, v_caches


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    keep = slot_mapping >= 0  # [T]: -1 marks a row to drop (index -1 would be the last slot)
    slots = slot_mapping[keep]
    # The flat view [num_blocks * block_size, kv_heads, head_dim] has one row per slot.
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep]


def gather(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's [seq_len, kv_heads, head_dim], in position order."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)  # table entries past these are padding
    blocks = cache[block_table[:num_blocks].long()]  # [num_blocks, block_size, kvh, hd]
    return blocks.flatten(0, 1)[:seq_len]  # the last block's unused slots are never read


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float,
                    sliding_window: int | None = None) -> torch.Tensor:
    out = torch.empty_like(q)  # [T, heads, head_dim]
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        rows = slice(starts[b], starts[b + 1])
        q_len = starts[b + 1] - starts[b]
        keys = gather(k_cache, block_tables[b], seq_len)  # [seq_len, kv_heads, head_dim]
        values = gather(v_cache, block_tables[b], seq_len)
        k_positions = torch.arange(seq_len, device=q.device)
        q_positions = k_positions[seq_len - q_len:]  # the queries are the sequence's last
        out[rows] = causal_attention(q[rows], keys, values, q_positions, k_positions, scale,
                                     sliding_window)
    return out


def copy_blocks(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                pairs: list[tuple[int, int]]) -> None:
    if not pairs:
        return
    src = torch.tensor([s for s, _ in pairs], device=k_caches[0].device)
    dst = torch.tensor([d for _, d in pairs], device=k_caches[0].device)
    for cache in (*k_caches, *v_caches):  # every layer, K and V
        cache[dst] = cache[src]
