"""Paged attention, the reference definition: decode attention read through block tables.

One decode step of a batch: each sequence has one new query and its K/V scattered over blocks
of the pool. Gather the sequence's blocks in block-table order, keep its first seq_len slots,
and attend as usual. A kernel never materialises the gather (it reads the blocks in place, one
block at a time); this definition does, and the Triton kernel of a later issue must match it.
"""

import torch

from .attention import causal_attention


# --8<-- [start:gather]
def gather_kv(cache: torch.Tensor, block_table: list[int] | torch.Tensor,
              seq_len: int) -> torch.Tensor:
    """cache [num_blocks, block_size, kv_heads, head_dim] -> this sequence's [seq_len, kv_heads,
    head_dim], in position order."""
    blocks = cache[torch.as_tensor(block_table, device=cache.device)]  # [n, block_size, kvh, hd]
    return blocks.flatten(0, 1)[:seq_len]  # slots past seq_len are never read
# --8<-- [end:gather]


# --8<-- [start:paged_attention]
def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: list[list[int]], seq_lens: list[int], scale: float,
                    sliding_window: int | None = None) -> torch.Tensor:
    """q [B, heads, head_dim]: each sequence's newest token, at position seq_len - 1.

    Returns [B, heads, head_dim]. K/V of the newest token must already be in the cache.
    """
    out = []
    for b, (table, seq_len) in enumerate(zip(block_tables, seq_lens, strict=True)):
        keys = gather_kv(k_cache, table, seq_len)  # [seq_len, kv_heads, head_dim]
        values = gather_kv(v_cache, table, seq_len)
        positions = torch.arange(seq_len, device=q.device)
        out.append(causal_attention(q[b: b + 1], keys, values, positions[-1:], positions, scale,
                                    sliding_window))
    return torch.cat(out)  # [B, heads, head_dim]
# --8<-- [end:paged_attention]
