"""store_kv: write one step's new K and V rows into the paged cache, each at its slot.

After the QKV projection and rotary, every token of the step has a K row and a V row of shape
[kv_heads, head_dim]. The block table has already given each token a *slot*: its row in the
flat cache view [num_blocks * block_size, kv_heads, head_dim], with -1 for padding rows whose
K/V must not be kept. This kernel is a scatter: one program per token (and per tile of heads)
reads the token's slot, then copies its K and V rows there.

Why a kernel for a copy? The torch twin (``pagedllm.reference.ops.store_kv``) first filters out
the -1 rows (a boolean mask, a host sync on ``.all()``, and gathered copies of k, v and the
slots) and then runs two indexed assignments. Here each K/V element is read once and written
once, padding rows cost one load of their slot, and K and V move in the same launch. The rows
may be strided views (K sliced out of a fused QKV output) since every stride is passed in.
"""

import torch
import triton
import triton.language as tl

from pagedllm.reference.ops import store_kv as store_kv_reference

from .runtime import kernel_runner


# --8<-- [start:kernel]
@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr,                    # [T, kv_heads, head_dim] each, any strides, last dim 1
    k_cache_ptr, v_cache_ptr,        # [num_blocks * block_size, kv_heads, head_dim] contiguous
    slot_ptr,                        # [T] int32/int64, -1 = skip
    stride_kt, stride_kh, stride_vt, stride_vh,
    kv_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    head_tile = tl.program_id(1)
    # int64: slot * row size overflows int32 once the cache holds more than 2**31 elements.
    slot = tl.load(slot_ptr + token).to(tl.int64)

    heads = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    dims = tl.arange(0, BLOCK_D)  # [BLOCK_D]; BLOCK_D >= head_dim (80, 96 are masked up to 128)
    # A padding row (slot -1) turns every lane off: nothing is read from k/v, nothing written.
    # (The slot is broadcast to the tile before the comparison: Triton 3.9's interpreter
    # mis-types a scalar comparison and-ed with a block mask.)
    slots = slot + tl.full([BLOCK_H, BLOCK_D], 0, dtype=tl.int64)  # [BH, BD]
    mask = (slots >= 0) & (heads[:, None] < kv_heads) & (dims[None, :] < head_dim)  # [BH, BD]

    src_k = k_ptr + token.to(tl.int64) * stride_kt + heads[:, None] * stride_kh + dims[None, :]
    src_v = v_ptr + token.to(tl.int64) * stride_vt + heads[:, None] * stride_vh + dims[None, :]
    # The cache is contiguous: a slot's row is kv_heads * head_dim elements.
    dst = slots * kv_heads * head_dim + heads[:, None] * head_dim + dims[None, :]  # [BH, BD]
    # A copy: no arithmetic, so the bits of any dtype (fp32, bf16, fp16) land unchanged.
    tl.store(k_cache_ptr + dst, tl.load(src_k, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(src_v, mask=mask), mask=mask)
# --8<-- [end:kernel]


# --8<-- [start:launcher]
def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Triton version of ``pagedllm.reference.ops.store_kv``, same arguments, same effect.

    k, v [T, kv_heads, head_dim] (last dim contiguous; other strides free); k_cache, v_cache
    [num_blocks, block_size, kv_heads, head_dim], contiguous; slot_mapping [T], -1 = skip.
    Slots must lie inside the cache: unlike the twin's indexing, the kernel does not check.
    """
    runner = kernel_runner(_store_kv_kernel, k, v, k_cache, v_cache, slot_mapping)
    if runner is None:
        return store_kv_reference(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return None
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("store_kv's kernel needs contiguous caches")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("store_kv's kernel needs k and v with a contiguous last dimension")
    block_d = triton.next_power_of_2(head_dim)
    # About 2048 elements per program: all heads of a token in one program for typical GQA
    # shapes (8 x 128), more tiles only for wide MHA caches.
    block_h = min(triton.next_power_of_2(kv_heads), max(1, 2048 // block_d))
    grid = (num_tokens, triton.cdiv(kv_heads, block_h))
    runner[grid](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_heads, head_dim,
        BLOCK_H=block_h, BLOCK_D=block_d,
    )
    return None
# --8<-- [end:launcher]
