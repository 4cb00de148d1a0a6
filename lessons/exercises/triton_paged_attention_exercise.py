"""Exercise (lesson 10, "The PagedAttention kernel"): the decode kernel's tile loop, in Triton.

A batch of B decodes has one query per sequence, q [B, heads, head_dim]. Sequence b has
seq_lens[b] tokens in the paged cache, k_cache and v_cache [num_blocks, block_size, kv_heads,
head_dim]: key position p lies in block block_tables[b, p // block_size], at slot
p % block_size. The query sits at the last position, so it sees every key 0 .. seq_len - 1.
heads may be a multiple of kv_heads (grouped-query attention): query head h reads K/V head
h // (heads // kv_heads).

Write the body of paged_decode_kernel below: one program per (sequence, query head) walks its
sequence's blocks through the block table, one block per tile, and keeps the online softmax's
running max, sum and accumulator (lesson 11), so that it never holds more than one block of
scores. The launcher, paged_decode, is written for you; once your kernel is written, delete the
line that raises NotImplementedError in it. Lesson 10's section "Exercise: the tile loop in
Triton" explains the kernel. Check your work with

    pytest lessons/exercises/test_triton_paged_attention_exercise.py

The test runs your kernel through Triton's interpreter on CPU tensors and compares it with
pagedllm.reference.ops.paged_attention: pools whose unwritten slots are NaN, blocks handed out
in shuffled order, lengths that end mid-block, block tables with padding entries, GQA and MQA,
and scores large enough that exp overflows without the running max. Until you edit this file
the test reports your version as skipped and checks only the solution.
"""

import torch
import triton
import triton.language as tl

from pagedllm.kernels.runtime import kernel_runner


@triton.jit
def paged_decode_kernel(
    out_ptr,                   # [B, heads, head_dim], contiguous: written
    q_ptr,                     # [B, heads, head_dim], contiguous: one query per sequence
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, kv_heads, head_dim], contiguous
    block_tables_ptr,          # [B, max_blocks] int32, contiguous
    seq_lens_ptr,              # [B]: tokens in the cache per sequence, at least 1
    scale,                     # softmax scale, head_dim ** -0.5 for most models
    max_blocks, num_heads, num_kv_heads,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,    # HEAD_DIM rounded up to a power of two
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block, a power of two
):
    """Program (b, h) (tl.program_id(0), tl.program_id(1)) writes out[b, h] =
    softmax(q[b, h] . k * scale) . v over the keys and values of positions 0 .. seq_lens[b] - 1
    of sequence b, K/V head h // (num_heads // num_kv_heads). Element (block, slot, kv_head, d)
    of a pool lies at offset ((block * BLOCK_SIZE + slot) * num_kv_heads + kv_head) * HEAD_DIM
    + d. Slots at or past seq_len, and block table entries past the sequence's last block, may
    hold anything (NaN in the test): they must not be loaded.
    """
    # Your code here: the whole body.


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """Decode attention, one query per sequence: q [B, heads, head_dim] over the paged cache
    k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim] through block_tables
    [B, max_blocks] and seq_lens [B] -> [B, heads, head_dim]. The same numbers as
    pagedllm.reference.ops.paged_attention with query_start_loc = [0, 1, ..., B]."""
    raise NotImplementedError("exercise: write paged_decode_kernel's body, then delete this line")
    runner = kernel_runner(paged_decode_kernel, q, k_cache, v_cache, block_tables, seq_lens)
    if runner is None:
        raise RuntimeError("this exercise runs its kernel: pass CUDA tensors, or set "
                           "TRITON_INTERPRET=1 to run it on the CPU through Triton's interpreter")
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not split into {num_kv_heads} groups")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size {block_size}: the kernel's tile is one block, a power of 2")
    if block_tables.shape[0] != num_seqs or seq_lens.shape != (num_seqs,):
        raise ValueError(f"{num_seqs} queries, {block_tables.shape[0]} block tables and "
                         f"{seq_lens.shape[0]} lengths: one each per sequence")
    q, k_cache, v_cache = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
    block_tables, seq_lens = block_tables.contiguous(), seq_lens.contiguous()
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    runner[(num_seqs, num_heads)](
        out, q, k_cache, v_cache, block_tables, seq_lens, scale,
        block_tables.shape[1], num_heads, num_kv_heads,
        HEAD_DIM=head_dim, HEAD_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
    )
    return out
