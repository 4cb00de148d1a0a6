"""MLA's absorbed decode over the paged latent cache in Triton (DeepSeek-V2/V3).

What it computes
----------------
Exactly what its twin ``pagedllm.reference.ops.mla.paged_mla_attention`` computes: for each
query row, attention in the latent space over its sequence's cached rows ``c_kv ‖ k_pe``,

    score_j = (q_latent · c_kv_j + q_pe · k_pe_j) * scale,   out_latent = Σ_j softmax_j c_kv_j,

with ``q_latent [T, H, R]`` the query already absorbed through W_UK and ``out_latent [T, H, R]``
still to be projected through W_UV (``reference/ops/mla.py`` derives both and says why decode
takes this form). The cache is one tensor a layer, ``kv_cache [num_blocks, block_size, R + P]``,
and the batch has the layout of paged attention's: sequence b owns rows
``query_start_loc[b]:query_start_loc[b + 1]``, its last q_len tokens, and row i sits at
position ``seq_len - q_len + i`` and reads keys up to its own position. A decode has one row; a
few rows a sequence (speculative decoding's proposals) work the same way. Rows past the last
sequence (padding of T) come out as 0.

One latent "head" for all query heads
-------------------------------------
MLA in the absorbed form is multi-query attention: every head of a token reads the same cached
row, and the row is both its key (c_kv and k_pe) and its value (c_kv again). So a program owns
one query row and a block of BLOCK_H heads, the heads stacked as the rows of a matrix product,
and streams its sequence's cache one tile of TILE_N key positions at a time. Each tile of
``c_kv`` is loaded once and used three ways: transposed for the scores of all BLOCK_H heads,
``[BLOCK_H, R] x [R, TILE_N]``, plus the rotary part ``[BLOCK_H, P] x [P, TILE_N]``, and as
it is for the output, ``[BLOCK_H, TILE_N] x [TILE_N, R]``. Per head the bytes read are those
of (R + P) / BLOCK_H numbers a key, where a per-head cache would read 2 * head_dim.

Why blocks of heads, not all of them: the accumulator is BLOCK_H x R floats in registers
(16 x 512 for DeepSeek-V2: 32 KiB a program, 64 registers a thread with 4 warps); 16 rows are
the smallest matrix product the tensor cores take, and more heads a program would spill. A
model with H heads gets ceil(H / 16) programs per query row (DeepSeek-V2's 128 heads: 8), each
reading the sequence's cache once; the rows past H of the last block are masked off.

Padded widths: the matrix products need dimensions of at least 16 and powers of two, so R and P
are padded (R_PAD, P_PAD) with masked loads giving 0, which adds nothing to any product. The
softmax is online and in float32 (FlashAttention's running max, sum and accumulator, base 2:
``kernels/paged_attention.py`` explains it); the probabilities are rounded to the input dtype
before the product with c_kv, as the twin rounds them.

The grid is ``(T, ceil(H / BLOCK_H))``: shapes only, no device-to-host copy. A program finds
its sequence by binary search over ``query_start_loc``, as paged attention's do; the programs of
padding rows write zeros. Positions at or past a query's own are masked before any load, so
unwritten slots (NaN in the tests) and the padding entries of the block tables are never read.

Not here (yet): flash-decoding's key splits (few sequences with long contexts leave SMs idle;
``paged_attention.py`` has the pattern), and a quantized latent cache.
"""

import torch
import triton
import triton.language as tl

from pagedllm.kernels.runtime import interpreting, kernel_runner
from pagedllm.reference.ops.mla import paged_mla_attention as paged_mla_attention_reference

__all__ = ["paged_mla_attention", "paged_mla_attention_reference"]

LOG2E = 1.4426950408889634  # log2(e): exp(x) == exp2(x * LOG2E)


@triton.jit
def _mla_decode_kernel(
    out_ptr,  # [T, H, R]
    q_latent_ptr,  # [T, H, R]
    q_pe_ptr,  # [T, H, P]
    kv_cache_ptr,  # [num_blocks, block_size, R + P]: c_kv ‖ k_pe a slot
    block_tables_ptr,  # [B, max_blocks]
    seq_lens_ptr,  # [B]
    query_start_loc_ptr,  # [B + 1]
    qk_scale,  # softmax scale * log2(e)
    num_seqs,  # B
    stride_ot, stride_oh,
    stride_qt, stride_qh,
    stride_pt, stride_ph,
    stride_cb, stride_cs,
    stride_bt,
    NUM_HEADS: tl.constexpr,  # H
    KV_LORA_RANK: tl.constexpr,  # R
    ROPE_DIM: tl.constexpr,  # P
    R_PAD: tl.constexpr,  # R rounded up to a power of two >= 16
    P_PAD: tl.constexpr,  # P rounded up to a power of two >= 16
    BLOCK_SIZE: tl.constexpr,  # cache block size (tokens)
    BLOCK_H: tl.constexpr,  # heads per program
    TILE_N: tl.constexpr,  # keys per tile
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no tf32 rounding)
    DOT_F32: tl.constexpr,  # interpreter with bf16: its tl.dot cannot multiply bf16, upcast
):
    token = tl.program_id(0)
    head_block = tl.program_id(1)

    # -- which sequence owns this query row: the last s with query_start_loc[s] <= token ----
    lo: tl.int32 = 0
    hi = num_seqs + 1
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) <= token:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1  # == num_seqs: a padding row after the last sequence
    is_seq = seq < num_seqs
    q_start = tl.load(query_start_loc_ptr + seq)
    q_end = tl.load(query_start_loc_ptr + seq + 1, mask=is_seq, other=0)
    seq_len = tl.load(seq_lens_ptr + seq, mask=is_seq, other=0)
    # one past the last key this row may read (its own position); padding: none
    kv_hi = tl.where(is_seq, seq_len - (q_end - q_start) + (token - q_start) + 1, 0)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < NUM_HEADS
    dims = tl.arange(0, R_PAD)
    dim_ok = dims < KV_LORA_RANK
    rope = tl.arange(0, P_PAD)
    rope_ok = rope < ROPE_DIM
    token64 = token.to(tl.int64)
    q = tl.load(q_latent_ptr + token64 * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_H, R_PAD]
    q_pe = tl.load(q_pe_ptr + token64 * stride_pt + heads[:, None] * stride_ph + rope[None, :],
                   mask=head_ok[:, None] & rope_ok[None, :], other=0.0)  # [BLOCK_H, P_PAD]
    if DOT_F32:
        q, q_pe = q.to(tl.float32), q_pe.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)  # running max (base 2)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)  # running sum of exp2(score - m)
    acc = tl.zeros([BLOCK_H, R_PAD], dtype=tl.float32)  # running sum of exp2(...) * c_kv
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    offs_n = tl.arange(0, TILE_N)
    for tile in range(0, tl.cdiv(kv_hi, TILE_N)):
        k_pos = tile * TILE_N + offs_n  # key positions of this tile
        k_ok = k_pos < kv_hi  # never a slot past the row's own position
        block = tl.load(table + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        rows = kv_cache_ptr + block * stride_cb + (k_pos % BLOCK_SIZE) * stride_cs  # [TILE_N]
        c = tl.load(rows[:, None] + dims[None, :], mask=k_ok[:, None] & dim_ok[None, :],
                    other=0.0).to(q.dtype)  # [TILE_N, R_PAD]: key and value at once
        k_pe = tl.load(rows[None, :] + KV_LORA_RANK + rope[:, None],
                       mask=k_ok[None, :] & rope_ok[:, None],
                       other=0.0).to(q.dtype)  # [P_PAD, TILE_N]
        s = tl.dot(q, tl.trans(c), input_precision=DOT_PRECISION)  # [BLOCK_H, TILE_N]
        s += tl.dot(q_pe, k_pe, input_precision=DOT_PRECISION)
        s = tl.where(k_ok[None, :], s * qk_scale, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no -inf - -inf
        alpha = tl.exp2(m_i - m_safe)  # rescales what was summed against the old max
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), c, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # no key (padding rows): 0
    tl.store(out_ptr + token64 * stride_ot + heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & dim_ok[None, :])


def _pad(n: int) -> int:
    """A matrix product's dimension: a power of two, at least 16."""
    return max(16, triton.next_power_of_2(n))


def paged_mla_attention(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, scale: float, *,
                        block_h: int | None = None, tile_n: int | None = None,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """The twin's op, ``paged_mla_attention_reference``, by one Triton kernel.

    q_latent [T, H, R], q_pe [T, H, P]; kv_cache [num_blocks, block_size, R + P];
    block_tables [B, max_blocks] int32; seq_lens [B]; query_start_loc [B + 1] with
    query_start_loc[0] == 0, on the host or on q's device (host copies are moved: the kernel
    reads the device ones). Returns out_latent [T, H, R] in q_latent's dtype; rows past
    query_start_loc[B] are 0.

    Keyword-only, for tests and benchmarks: ``block_h`` heads per program (a power of two
    >= 16), ``tile_n`` keys per tile (a power of two >= 16), ``out`` a [T, H, R] tensor to write
    into (every row is written) and return.
    """
    T, num_heads, rank = q_latent.shape
    rope_dim = q_pe.shape[-1]
    if kv_cache.shape[-1] != rank + rope_dim or q_pe.shape[:2] != (T, num_heads):
        raise ValueError(f"kv_cache rows of {kv_cache.shape[-1]} must hold c_kv ({rank}) and "
                         f"k_pe ({rope_dim}); q_pe {tuple(q_pe.shape)} must be [T, H, P] of "
                         f"q_latent's T {T} and H {num_heads}")
    seq_lens = seq_lens.to(q_latent.device)  # no-ops when already there
    query_start_loc = query_start_loc.to(q_latent.device)
    runner = kernel_runner(_mla_decode_kernel, q_latent, q_pe, kv_cache, block_tables,
                           seq_lens, query_start_loc)
    if runner is None:  # CPU without the interpreter: the twin
        result = paged_mla_attention_reference(q_latent, q_pe, kv_cache, block_tables,
                                               seq_lens, query_start_loc, scale)
        return result if out is None else out.copy_(result)
    if out is None:
        out = torch.empty_like(q_latent)  # every row is written: no memset
    if T == 0:
        return out
    # The kernel indexes the last dimension with stride 1.
    q_latent, q_pe = (x if x.stride(-1) == 1 else x.contiguous() for x in (q_latent, q_pe))
    if kv_cache.stride(-1) != 1:
        kv_cache = kv_cache.contiguous()
    block_tables = block_tables.contiguous()
    seq_lens, query_start_loc = seq_lens.contiguous(), query_start_loc.contiguous()
    heads = block_h or 16
    tile = tile_n or (32 if q_latent.element_size() <= 2 else 16)  # fp32: half the tile
    for name, value in (("block_h", heads), ("tile_n", tile)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name}={value}: a power of two >= 16")
    grid = (T, triton.cdiv(num_heads, heads))
    runner[grid](
        out, q_latent, q_pe, kv_cache, block_tables, seq_lens, query_start_loc,
        scale * LOG2E, block_tables.shape[0],
        out.stride(0), out.stride(1), q_latent.stride(0), q_latent.stride(1),
        q_pe.stride(0), q_pe.stride(1), kv_cache.stride(0), kv_cache.stride(1),
        block_tables.stride(0),
        NUM_HEADS=num_heads, KV_LORA_RANK=rank, ROPE_DIM=rope_dim, R_PAD=_pad(rank),
        P_PAD=_pad(rope_dim), BLOCK_SIZE=kv_cache.shape[1], BLOCK_H=heads, TILE_N=tile,
        DOT_PRECISION="ieee" if q_latent.dtype == torch.float32 else "tf32",
        DOT_F32=q_latent.dtype == torch.bfloat16 and interpreting(),
        # fp32: 8 warps, as 4 spill on sm_80 (255 registers a thread); 16-bit inputs fit
        # 4 (192): python -m pagedllm.kernels.compile_check measures both
        num_warps=8 if q_latent.element_size() > 2 else 4, num_stages=2,
    )
    return out
