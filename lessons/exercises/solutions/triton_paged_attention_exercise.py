"""Solution to lesson 10's Triton exercise: decode attention walking the block table, with the
online softmax of lesson 11, one program per (sequence, query head)."""

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
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    kv_head = head // (num_heads // num_kv_heads)  # GQA: a group of query heads per K/V head
    seq_len = tl.load(seq_lens_ptr + seq)
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + (seq * num_heads + head) * HEAD_DIM + dims, mask=dim_ok,
                other=0.0).to(tl.float32)  # [HEAD_PAD]
    offs = tl.arange(0, BLOCK_SIZE)  # a slot of the block

    m_i = float("-inf")  # running max of the scores
    l_i = 0.0  # running sum of exp(score - m_i)
    acc = tl.zeros([HEAD_PAD], dtype=tl.float32)  # running sum of exp(score - m_i) * value
    # One tile is one block: logical block i of the sequence, wherever the table put it.
    for i in range(tl.cdiv(seq_len, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + seq * max_blocks + i).to(tl.int64)
        pos = i * BLOCK_SIZE + offs  # [BLOCK_SIZE] key positions
        ok = pos < seq_len  # the last block may be part full: never load past seq_len
        rows = (block * BLOCK_SIZE + offs) * num_kv_heads + kv_head  # [BLOCK_SIZE] (slot, head)
        mask = ok[:, None] & dim_ok[None, :]  # [BLOCK_SIZE, HEAD_PAD]
        k = tl.load(k_cache_ptr + rows[:, None] * HEAD_DIM + dims[None, :], mask=mask,
                    other=0.0).to(tl.float32)  # [BLOCK_SIZE, HEAD_PAD]
        v = tl.load(v_cache_ptr + rows[:, None] * HEAD_DIM + dims[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        # A vector times a tile: elementwise and summed. (The real kernel stacks the group's
        # heads into a [16+, HEAD_PAD] tile to use tl.dot, whose every side must be >= 16.)
        s = tl.sum(k * q[None, :], axis=1) * scale  # [BLOCK_SIZE]
        s = tl.where(ok, s, float("-inf"))
        # Every block in range holds position i * BLOCK_SIZE < seq_len, so m_new is finite:
        # no -inf - -inf here (the real kernel needs m_safe for fully masked tiles).
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp(m_i - m_new)  # rescales what was summed against the old max
        p = tl.exp(s - m_new)  # [BLOCK_SIZE], 0 for masked slots
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    out = acc / l_i
    tl.store(out_ptr + (seq * num_heads + head) * HEAD_DIM + dims,
             out.to(out_ptr.dtype.element_ty), mask=dim_ok)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """Decode attention, one query per sequence: q [B, heads, head_dim] over the paged cache
    k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim] through block_tables
    [B, max_blocks] and seq_lens [B] -> [B, heads, head_dim]. The same numbers as
    pagedllm.reference.ops.paged_attention with query_start_loc = [0, 1, ..., B]."""
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
