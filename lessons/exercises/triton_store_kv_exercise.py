"""Exercise (lesson 13, "Fusing the small ops"): store_kv as a Triton kernel.

One engine step computes a K row and a V row for each of its T tokens, k and v of shape
[T, kv_heads, head_dim]. The block table has already given every token a *slot*: its row in
the flat view of the paged pool, [num_blocks * block_size, kv_heads, head_dim]. Slot -1 marks
a padding row, whose K and V must not be stored anywhere. The torch twin,
pagedllm.reference.ops.store_kv, drops the -1 rows and then makes two indexed assignments.

Write the body of store_kv_kernel below: one program per token copies that token's K rows and
V rows (every KV head) to its slot, and a token with slot -1 changes nothing. The launcher,
store_kv, is written for you; once your kernel is written, delete the line that raises
NotImplementedError in it. Lesson 13's section "Exercise: store_kv in Triton" explains the
kernel; lesson 10's "Running it on a CPU" how it runs without a GPU. Check your work with

    pytest lessons/exercises/test_triton_store_kv_exercise.py

The test runs your kernel through Triton's interpreter on CPU tensors and compares the pools
it leaves, bit for bit, with the twin's, on pools whose every slot starts as NaN, with padding
rows, non-power-of-two head counts and sizes, and k, v sliced out of a fused QKV tensor (rows
that are not contiguous). Until you edit this file the test reports your version as skipped
and checks only the solution.
"""

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
    """Program t (tl.program_id(0)) stores token t: k[t, h, d], at k_ptr + t * stride_kt +
    h * stride_kh + d, goes to row (slot, h) of the K pool, and v[t] to the V pool the same
    way. With slot -1 nothing is written. Element (slot, h, d) of a pool lies at offset
    (slot * kv_heads + h) * head_dim + d; lanes past kv_heads or head_dim must not be touched.
    """
    # Your code here: the whole body.


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k, v [T, kv_heads, head_dim] into k_cache, v_cache [num_blocks, block_size,
    kv_heads, head_dim] at the slots slot_mapping [T] (-1: skip), like
    pagedllm.reference.ops.store_kv."""
    raise NotImplementedError("exercise: write store_kv_kernel's body, then delete this line")
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
