"""The three ways K/V data moves between slots: a step's writes, copy-on-write, and swapping.

The cache is one tensor per layer and kind, [num_blocks, block_size, kv_heads, head_dim]; a
token's slot is its row in the flat view [num_blocks * block_size, kv_heads, head_dim]. Which
slot a token takes is decided by bookkeeping (the block table); these functions only move data.
"""

import torch


# --8<-- [start:store_kv]
def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write the step's new K and V rows [T, kv_heads, head_dim] at their slots [T].

    A slot of -1 marks a row whose K/V must not be kept (padding): it is skipped.
    """
    keep = slot_mapping >= 0  # [T]
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = k  # flat view: one row per slot
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = v
# --8<-- [end:store_kv]


# --8<-- [start:copy_blocks]
def copy_blocks(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                block_mapping: torch.Tensor) -> None:
    """Copy-on-write for a whole step: for each (src, dst) row of block_mapping [N, 2], block
    dst becomes a copy of block src, in every layer, K and V."""
    if block_mapping.numel() == 0:
        return
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    for cache in (*k_caches, *v_caches):
        cache[dst] = cache[src]
# --8<-- [end:copy_blocks]


# --8<-- [start:swap_blocks]
def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Move whole blocks between two caches of one layer (GPU <-> CPU): for each (s, d) row of
    block_mapping [N, 2], dst[d] = src[s]."""
    if block_mapping.numel() == 0:
        return
    s, d = block_mapping[:, 0], block_mapping[:, 1]
    dst[d.to(dst.device)] = src[s.to(src.device)].to(dst.device)
# --8<-- [end:swap_blocks]
