"""Solution to lesson 13's Triton exercise: store_kv as one kernel, one program per token."""

import torch
import triton
import triton.language as tl

from pagedllm.kernels.runtime import kernel_runner


@triton.jit
def store_kv_kernel(
    k_ptr, v_ptr,              # [T, kv_heads, head_dim] each, last dimension contiguous
    k_cache_ptr, v_cache_ptr,  # [num_blocks * block_size, kv_heads, head_dim], contiguous
    slot_ptr,                  # [T] int32 or int64: each token's slot, -1 = not stored
    stride_kt, stride_kh,      # k's strides (elements) over tokens and heads
    stride_vt, stride_vh,      # v's
    kv_heads, head_dim,
    BLOCK_H: tl.constexpr,     # kv_heads rounded up to a power of two
    BLOCK_D: tl.constexpr,     # head_dim rounded up to a power of two
):
    token = tl.program_id(0).to(tl.int64)
    # int64: slot * kv_heads * head_dim passes 2**31 once the pool holds over 2**31 elements.
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # a padding row: its K/V are thrown away, and nothing else is read
        return
    heads = tl.arange(0, BLOCK_H)  # [BH]
    dims = tl.arange(0, BLOCK_D)  # [BD]
    # The tile is padded to powers of two; the lanes past kv_heads or head_dim are switched off.
    mask = (heads < kv_heads)[:, None] & (dims < head_dim)[None, :]  # [BH, BD]
    # The source rows may be strided views (K and V sliced out of a fused QKV output) ...
    k_src = k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :]  # [BH, BD]
    v_src = v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :]
    # ... the destination is the contiguous pool: row (slot, head) of the flat view.
    dst = (slot * kv_heads + heads[:, None]) * head_dim + dims[None, :]  # [BH, BD]
    tl.store(k_cache_ptr + dst, tl.load(k_src, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(v_src, mask=mask), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k, v [T, kv_heads, head_dim] into k_cache, v_cache [num_blocks, block_size,
    kv_heads, head_dim] at the slots slot_mapping [T] (-1: skip), like
    pagedllm.reference.ops.store_kv."""
    runner = kernel_runner(store_kv_kernel, k, v, k_cache, v_cache, slot_mapping)
    if runner is None:
        raise RuntimeError("this exercise runs its kernel: pass CUDA tensors, or set "
                           "TRITON_INTERPRET=1 to run it on the CPU through Triton's interpreter")
    num_tokens, kv_heads, head_dim = k.shape
    if k_cache.shape[2:] != (kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"k, v {tuple(k.shape)}, {tuple(v.shape)} do not fit a cache of rows "
                         f"{tuple(k_cache.shape[2:])}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the kernel addresses the pool as contiguous: pass contiguous caches")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("the kernel reads k and v rows with stride 1: their last dimension "
                         "must be contiguous")
    if num_tokens == 0:
        return
    runner[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_heads, head_dim,
        BLOCK_H=triton.next_power_of_2(kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )
