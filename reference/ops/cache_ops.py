"""The three ways K/V data moves between slots: a step's writes, copy-on-write, and swapping.

The cache is one tensor per layer and kind, [num_blocks, block_size, kv_heads, head_dim]; a
token's slot is its row in the flat view [num_blocks * block_size, kv_heads, head_dim]. Which
slot a token takes is decided by bookkeeping (the block table); these functions only move data.

A quantized cache (``kv_quant.py``) stores fewer bits per value: store_kv quantizes on the way
in, and per-token-head formats keep a scale per slot and KV head in a second tensor of the same
block layout, [num_blocks, block_size, kv_heads], which copy_blocks and swap_blocks move like
any other cache (they work on whole blocks of any tensor).
"""

import torch

from .kv_quant import quantize_kv


# --8<-- [start:store_kv]
def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor,
             kv_cache_dtype: str = "auto", k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Write the step's new K and V rows [T, kv_heads, head_dim] at their slots [T].

    A slot of -1 marks a row whose K/V must not be kept (padding): it is skipped. A
    quantized kv_cache_dtype stores the rows quantized: fp8 divides by the layer's
    k_scale / v_scale [1]; int8 and int4 compute each row's scale (int4: scale and zero)
    and write it at the same slot of k_scale / v_scale
    [num_blocks, block_size, kv_heads] (int4: [..., 2]). A 16-bit cache of another
    dtype than the model's (kv_cache_dtype "float16" beside a bf16 model) takes the rows
    rounded to its dtype.
    """
    keep = slot_mapping >= 0  # [T]
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        # [T, kv_heads, stored], [T, kv_heads] (int4: [T, kv_heads, 2]) or None
        data, row_scales = quantize_kv(x, kv_cache_dtype, scale)
        # a flat view: one row per slot
        cache.view(-1, *cache.shape[2:])[slot_mapping] = data.to(cache.dtype)
        if row_scales is not None:
            scale.view(-1, *scale.shape[2:])[slot_mapping] = row_scales
# --8<-- [end:store_kv]


# --8<-- [start:copy_blocks]
def copy_blocks(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                block_mapping: torch.Tensor) -> None:
    """Copy-on-write for a whole step: for each (src, dst) row of block_mapping [N, 2],
    block dst becomes a copy of block src, in every layer, K and V."""
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
