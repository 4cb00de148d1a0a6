"""Paged attention in Triton: one kernel for every query shape of an engine step.

What it computes
----------------
Exactly what its twin ``pagedllm.reference.ops.paged_attention`` computes. One step of the engine
hands over a flat batch of query rows, ``q [T, heads, head_dim]``, from B sequences: sequence b
owns rows ``query_start_loc[b]:query_start_loc[b + 1]``, and these rows are its *last* q_len
tokens. A decode has one row, a prefill its whole prompt, a chunked prefill one chunk, a prompt
found in the prefix cache only its uncached tail. With ``seq_len`` tokens in the cache (this
step's already stored), query row i sits at position ``seq_len - q_len + i`` and attends, causally
by position, to the keys and values of positions ``0 .. seq_len - 1`` of its sequence (with a
sliding window w, only to those after ``position - w``). Rows past the last sequence (padding of
T) come out as 0, like the twin's.

Follow the block table, do not gather
-------------------------------------
The cache is a pool of blocks, ``k_cache [num_blocks, block_size, kv_heads, head_dim]``. The twin
gathers a sequence's blocks into one dense run and attends as usual: a copy of every key and
value it reads. The kernel instead walks the sequence's row of ``block_tables`` and reads the
blocks where they lie. Key position p lives in physical block ``block_tables[b, p // block_size]``
at slot ``p % block_size``, so each program loads a *tile* of TILE_N key positions (a part of a
block, one block or several, whatever TILE_N and block_size say) by looking up each position's
block: a handful of extra integer loads per tile, no extra pass over the cache. Positions at or
past seq_len are masked off before any load, so unwritten slots (stale, or NaN in the tests) and
the padding entries of the block table are never read.

The online softmax
------------------
A program never holds all the scores of a row: it meets the keys one tile at a time and keeps,
per query row, three running quantities (FlashAttention):

- ``m``, the largest score seen so far;
- ``l``, the sum of ``exp(score - m)`` over the keys seen so far;
- ``acc``, the sum of ``exp(score - m) * value`` over the same keys, a head_dim vector.

When a new tile raises the maximum from m to m', every term summed so far was computed against
the old m and is too large by ``exp(m' - m)``: multiplying l and acc by ``alpha = exp(m - m')``
rescales them, then the tile's own terms are added. At the end ``acc / l`` is the softmax-weighted
sum of values, exactly, without a second pass and with memory for one tile. (The kernel works in
base 2: the scores are scaled by ``scale * log2(e)`` and ``exp2`` replaces ``exp``; the same
numbers, a cheaper instruction.) A row that has seen no visible key yet has ``m = -inf``; the
kernel subtracts 0 instead in that case, so nothing turns into ``-inf - -inf = NaN``.

GQA: one program per K/V head and group of queries
--------------------------------------------------
With grouped-query attention, ``group = heads // kv_heads`` query heads share one K/V head (one
K/V head for all of them: multi-query attention). A program owns one K/V head and BLOCK_Q
consecutive queries of one sequence, and stacks the whole group of each query as rows of one
matrix: row r is query ``r // group``, head ``kv_head * group + r % group``, BLOCK_M = BLOCK_Q *
group rows (rounded up to a power of two, the extra rows masked). Each K/V tile is then loaded
from memory once and used by every head of the group in one matrix product, instead of once per
query head. This matters most for decodes: one query per sequence, attention a pure stream over
the cache, so reading K/V once per group divides the bytes by the group size; and the rows of the
group are what fill the minimum 16-row matrix product.

Which program does what, without asking the host
------------------------------------------------
The grid's first axis enumerates query blocks of all sequences together. Sequence b's blocks are
numbered from ``query_start_loc[b] // BLOCK_Q + b`` on (at most ``ceil(q_len / BLOCK_Q)`` of them
fit before the next sequence's first one), so a program finds its sequence by a binary search over
``query_start_loc`` *inside the kernel* (vLLM's unified attention does the same), and the grid
size ``T // BLOCK_Q + B + 1`` is known from shapes alone: no device-to-host copy of the sequence
lengths. The programs left over return at once; the last "sequence", rows
``query_start_loc[B]:T``, is the padding, whose programs write zeros.

Flash-decoding: split the keys when there are too few programs
----------------------------------------------------------------
A batch of decodes gives B * kv_heads programs, each streaming one sequence's whole context. With
few sequences and long contexts that is too few programs to keep every multiprocessor of a GPU
reading: 8 sequences x 8 K/V heads is 64 programs for 132 SMs, and each one walks 8192 keys alone.
Flash-decoding splits every sequence's key range into NUM_SPLITS parts handled by different
programs (the grid's third axis). Each writes its partial (m, l, acc) instead of an output, and a
second, small kernel combines a row's partials: with M the largest of the m_s,
``out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s``. The extra cost is writing and reading
the partials, ``T * heads * splits * (head_dim + 2)`` floats: small next to the K/V of long
contexts, not worth it for short ones or when the batch already fills the GPU. The heuristic
(``choose_num_splits``): split only batches of decodes (one query per sequence); aim at about
four programs per SM; never give a split fewer than 256 keys of the longest context; at most 16
splits. Tests force either path with ``num_splits=``.

Reading a quantized cache
-------------------------
With a quantized ``kv_cache_dtype`` (``reference/ops/kv_quant.py``) the pool holds fp8 bytes,
int8 values, or two int4 values per byte, and the kernel dequantizes each tile in registers,
right after loading it: never a dequantized copy of the cache, so attention reads a half (fp8,
int8) or a quarter (int4) of a bf16 pool's bytes. What keeps it cheap is where the scales go.

- int8 keeps one scale per token and KV head, that is one per *key column* of a tile:
  k_j = s_j * k_int_j, so ``q . k_j = s_j * (q . k_int_j)``. The tile of small integers goes into
  the matrix product as it is (converted to q's dtype, which holds them exactly), and the
  product's [BLOCK_M, TILE_N] scores are multiplied column by column by the scales of the
  tile's keys. V the same way, from the other side: ``sum_j p_j (s_j v_int_j) = sum_j (p_j s_j)
  v_int_j``, so the probabilities are scaled before the P.V product (the softmax's sum l is
  still that of the unscaled p).
- int4 is asymmetric: a scale and a zero per token and KV head, k_j = s_j * k_int_j + z_j
  (k_int in 0..15, the same z_j added to every element of the row). The zero point costs one
  term per score and one per output row, both outside the matrix products:
  ``q . k_j = s_j * (q . k_int_j) + z_j * sum_d q_d``, where sum_d q_d is computed once per query
  row before the loop; and ``sum_j p_j (s_j v_int_j + z_j) = sum_j (p_j s_j) v_int_j +
  sum_j p_j z_j``, the last a number per query row, the same for every element of the output:
  it is kept as a running sum (rescaled by alpha like acc) and added to every column of the
  output at the end. The Hadamard rotation int4 caches are stored in is applied to q, k and v
  outside this kernel (the attention context), which sees rotated rows and does not know.
- int4 stores element d of a row in the low nibble of byte d and element d + head_dim / 2 in
  the high nibble. One load of the [head_dim / 2, TILE_N] bytes gives two tiles, ``b & 15`` and
  ``b >> 4``: the first and second halves of the keys. q is loaded as two halves too, and
  q . k_int is the sum of two half-width products; for V, the two halves of the output are
  accumulated apart (acc_lo, acc_hi; both get the zero-point term) and stored side by side.
- fp8 keeps one scale per layer for K and one for V: k_scale joins the softmax scale, v_scale
  multiplies the output once. The tile is read as bytes and widened by bit arithmetic: an fp8
  number is the top of an fp16 one (e5m2 exactly the upper byte; e4m3 a 3-bit mantissa and a
  4-bit exponent, shifted into place and multiplied by 2 ** 8 for the difference in exponent
  bias), so the conversion is exact and needs no fp8 support from the GPU: an A100, which
  Triton gives no e4m3 type, runs it like an H100.

Slots a sequence never wrote (stale, or NaN scales and zeros in the tests) are masked before any
load, as for an unquantized cache; a masked scale or zero loads as 0, and a masked key's score
is -inf anyway.

What the launcher needs on the host
-----------------------------------
Shapes (T, B, heads, block size, block table width) and, for choosing tile sizes and the split
count, the longest query and the longest context. The engine passes host copies of ``seq_lens``
and ``query_start_loc`` (the model's ``AttentionMetadata`` keeps them), so these maxima cost
nothing. Given device tensors instead, the launcher does not synchronise to read them: it uses
bounds known from shapes, ``T - B + 1`` for the longest query (every sequence has at least one
row) and ``block_tables.shape[1] * block_size`` for the longest context. Either way the kernel
itself reads the device copies; host copies are moved to q's device (one small copy each).
Correctness never depends on these choices, only speed.
"""

from functools import cache

import torch
import triton
import triton.language as tl

from pagedllm.kernels.runtime import interpreting, kernel_runner
from pagedllm.reference.ops import kv_cache_format
from pagedllm.reference.ops import paged_attention as paged_attention_reference

__all__ = ["choose_num_splits", "paged_attention", "paged_attention_reference"]

LOG2E = 1.4426950408889634  # log2(e): exp(x) == exp2(x * LOG2E)
MIN_KEYS_PER_SPLIT = 256  # flash-decoding: a split shorter than this costs more than it gains
MAX_SPLITS = 16
PROGRAMS_PER_SM = 4  # enough resident programs per multiprocessor to hide memory latency


# --8<-- [start:dequantize]
@triton.jit
def _fp8_to_f32(b, E5M2: tl.constexpr):
    """fp8 bytes (uint8 tile) to their fp32 values, exactly, through the fp16 with the
    same bits: sign in place, exponent and mantissa shifted to the top of fp16's fields.

    e4m3 has no infinities and one NaN, 0x7F (and 0xFF), which reads as 480 here:
    store_kv stores it only for a NaN key or value, whose query is NaN as well.
    (Selecting NaN for it made ptxas spill 2.7 KB per thread in sm_80's prefill
    tiles.)"""
    b = b.to(tl.int32)
    SHIFT: tl.constexpr = 8 if E5M2 else 7  # 10 - mantissa bits
    half = ((b & 0x80) << 8) | ((b & 0x7F) << SHIFT)  # [...] fp16 bits
    x = half.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    if not E5M2:
        # e4m3's exponent bias is 7, fp16's 15: a factor 2 ** 8 apart, exactly
        x = x * 256.0
    return x


@triton.jit
def _dequantize(x, KV_FORMAT: tl.constexpr, dtype: tl.constexpr):
    """A tile as the cache stores it to the values the matrix product takes, in dtype:
    exact (small integers, fp8 values), per-token-head and per-tensor scales left to the
    caller."""
    if KV_FORMAT == "fp8_e4m3" or KV_FORMAT == "fp8_e5m2":
        x = _fp8_to_f32(x, KV_FORMAT == "fp8_e5m2")
    elif KV_FORMAT == "int8":
        # int8 -> fp32 -> dtype: the interpreter has no int -> bf16 cast
        x = x.to(tl.float32)
    return x.to(dtype)


@triton.jit
def _nibbles(b, HIGH: tl.constexpr, dtype: tl.constexpr):
    """int4 bytes (uint8 tile) to the values 0..15 of their low (HIGH False) or high
    nibbles."""
    b = b.to(tl.int32)
    if HIGH:
        b = b >> 4
    return (b & 15).to(tl.float32).to(dtype)


@triton.jit
def _load_scales(scale_ptr, block, slot, kv_head, stride_sb, stride_ss, stride_sh, k_ok,
                 OFFSET: tl.constexpr = 0):
    """The per-token-head scales of a tile's keys [TILE_N] (int4: OFFSET 0 the scales, 1
    the zeros), bf16 to fp32 by their bits (0 for masked keys: a NaN-poisoned unused
    slot is never read)."""
    s = tl.load(scale_ptr + block * stride_sb + slot * stride_ss + kv_head * stride_sh
                + OFFSET, mask=k_ok, other=0.0)
    bits = s.to(tl.uint16, bitcast=True).to(tl.uint32) << 16
    return bits.to(tl.float32, bitcast=True)
# --8<-- [end:dequantize]


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [T, heads, head_dim]: written when NUM_SPLITS == 1
    part_acc_ptr,  # [T, heads, NUM_SPLITS, HEAD_PAD] fp32: written when NUM_SPLITS > 1
    part_max_ptr,  # [T, heads, NUM_SPLITS] fp32 (base-2 units)
    part_sum_ptr,  # [T, heads, NUM_SPLITS] fp32
    q_ptr,  # [T, heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, kv_heads, stored]: stored = head_dim (int4: / 2)
    v_cache_ptr,  # [num_blocks, block_size, kv_heads, stored]
    k_scale_ptr,  # fp8: [1] fp32; int8: [num_blocks, block_size, kv_heads] bf16; int4:
                  # [num_blocks, block_size, kv_heads, 2] bf16, (scale, zero)
    v_scale_ptr,  # the same for V (auto: unused)
    block_tables_ptr,  # [B, max_blocks]
    seq_lens_ptr,  # [B]
    query_start_loc_ptr,  # [B + 1]
    qk_scale,  # softmax scale * log2(e)
    num_seqs,  # B
    num_tokens,  # T
    window,  # sliding window (used when SLIDING)
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_sb, stride_ss, stride_sh,  # the per-token-head scales' block, slot, head strides
                                      # (int4: the pair's own stride is 1)
    HEAD_DIM: tl.constexpr,  # head_dim
    HEAD_PAD: tl.constexpr,  # head_dim rounded up to a power of two (int4: two halves of >= 16)
    BLOCK_SIZE: tl.constexpr,  # cache block size (tokens)
    GROUP: tl.constexpr,  # query heads per K/V head
    BLOCK_M: tl.constexpr,  # rows per program: BLOCK_Q queries x GROUP heads, padded
    BLOCK_Q: tl.constexpr,  # queries per program
    TILE_N: tl.constexpr,  # keys per tile
    NUM_SPLITS: tl.constexpr,  # key splits (flash-decoding); 1: single pass
    SLIDING: tl.constexpr,  # sliding window on
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no tf32 rounding)
    DOT_F32: tl.constexpr,  # interpreter with bf16: its tl.dot cannot multiply bf16, upcast
    KV_FORMAT: tl.constexpr,  # auto | fp8_e4m3 | fp8_e5m2 | int8 | int4
):
    block_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # --8<-- [start:find_sequence]
    # -- which sequence, which of its queries -----------------------------------------
    # The segment (a sequence, or the padding after the last one) owning this query block:
    # the last s with query_start_loc[s] // BLOCK_Q + s <= block_idx, by binary search.
    lo: tl.int32 = 0
    hi = num_seqs + 1
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= block_idx:
            lo = mid + 1
        else:
            hi = mid
    seg = lo - 1
    if seg < 0:  # only if query_start_loc[0] > 0, which the engine never produces
        return
    is_seq = seg < num_seqs  # seg == num_seqs: the padding rows after the last sequence
    q_start = tl.load(query_start_loc_ptr + seg)
    q_end = tl.load(query_start_loc_ptr + seg + 1, mask=is_seq, other=num_tokens)
    seq_len = tl.load(seq_lens_ptr + seg, mask=is_seq, other=0)  # padding: no keys at all
    q_len = q_end - q_start
    # this program's block within its sequence
    q_block = block_idx - (q_start // BLOCK_Q + seg)
    if q_block * BLOCK_Q >= q_len:
        return  # a left-over program: the grid is an upper bound
    context_len = seq_len - q_len  # query i sits at position context_len + i
    # --8<-- [end:find_sequence]

    # --8<-- [start:gqa_rows]
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + rows // GROUP  # query within the sequence
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows // GROUP < BLOCK_Q) & (q_idx < q_len)
    token = (q_start + q_idx).to(tl.int64)  # row of q / out
    q_pos = context_len + q_idx
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_DIM
    # [BLOCK_M]: where each row starts
    q_rows = q_ptr + token * stride_qt + head * stride_qh

    q = tl.load(q_rows[:, None] + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_M, HEAD_PAD]
    if DOT_F32:
        q = q.to(tl.float32)
    # --8<-- [end:gqa_rows]
    INT4: tl.constexpr = KV_FORMAT == "int4"
    PER_TOKEN: tl.constexpr = KV_FORMAT == "int8" or KV_FORMAT == "int4"  # scales per key
    FP8: tl.constexpr = KV_FORMAT == "fp8_e4m3" or KV_FORMAT == "fp8_e5m2"  # one per layer
    if FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)  # q . (k_scale k) = k_scale (q . k)
    # int4: element d and d + HEAD_DIM / 2 share byte d, so q is taken as its two halves.
    HALF: tl.constexpr = HEAD_DIM // 2
    halves = tl.arange(0, HEAD_PAD // 2)  # [HEAD_PAD / 2]
    half_ok = halves < HALF
    if INT4:
        q_lo = tl.load(q_rows[:, None] + halves[None, :], mask=row_ok[:, None] & half_ok[None, :],
                       other=0.0).to(q.dtype)  # [BLOCK_M, HEAD_PAD / 2]
        q_hi = tl.load(q_rows[:, None] + HALF + halves[None, :],
                       mask=row_ok[:, None] & half_ok[None, :], other=0.0).to(q.dtype)
        # sum_d q_d, for the zero points' term z_j * sum_d q_d of every score
        q_sum = tl.sum(q_lo.to(tl.float32), axis=1) + tl.sum(q_hi.to(tl.float32), axis=1)

    # --8<-- [start:key_range]
    # -- the keys this block of queries may see, and this split's share of their tiles
    last_q = tl.minimum(q_len, (q_block + 1) * BLOCK_Q)  # one past the block's last query
    kv_hi = tl.minimum(seq_len, context_len + last_q)  # one past the last visible key
    kv_lo = 0
    if SLIDING:
        kv_lo = tl.maximum(context_len + q_block * BLOCK_Q - window + 1, 0)
    tile_lo = kv_lo // TILE_N
    tile_hi = tl.cdiv(kv_hi, TILE_N)
    # --8<-- [end:key_range]
    # --8<-- [start:split_range]
    if NUM_SPLITS > 1:
        per_split = tl.cdiv(tile_hi - tile_lo, NUM_SPLITS)
        tile_lo = tile_lo + split * per_split
        tile_hi = tl.minimum(tile_hi, tile_lo + per_split)
    # --8<-- [end:split_range]

    # --8<-- [start:tile_loop]
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max (base 2)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2(score - m)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)  # running sum of exp2(...) * v
    if INT4:  # the two halves of acc, kept apart (acc itself is then unused)
        acc_lo = tl.zeros([BLOCK_M, HEAD_PAD // 2], dtype=tl.float32)
        acc_hi = tl.zeros([BLOCK_M, HEAD_PAD // 2], dtype=tl.float32)
        # running sum_j p_j z_j of V's zeros
        acc_zero = tl.zeros([BLOCK_M], dtype=tl.float32)
    table = block_tables_ptr + seg.to(tl.int64) * stride_bt
    offs_n = tl.arange(0, TILE_N)

    # --8<-- [start:tile_addresses]
    for tile in range(tile_lo, tile_hi):
        k_pos = tile * TILE_N + offs_n  # key positions of this tile
        k_ok = k_pos < kv_hi  # never a slot at or past seq_len
        block = tl.load(table + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        slot = k_pos % BLOCK_SIZE
        k_rows = k_cache_ptr + block * stride_kb + slot * stride_ks + kv_head * stride_kh
        v_rows = v_cache_ptr + block * stride_vb + slot * stride_vs + kv_head * stride_vh
        if INT4:  # bytes: two half-rows each
            k = tl.load(k_rows[None, :] + halves[:, None],
                        mask=k_ok[None, :] & half_ok[:, None],
                        other=0)  # [HEAD_PAD / 2, TILE_N]
            v = tl.load(v_rows[:, None] + halves[None, :],
                        mask=k_ok[:, None] & half_ok[None, :],
                        other=0)  # [TILE_N, HEAD_PAD / 2]
        else:
            k = tl.load(k_rows[None, :] + dims[:, None],
                        mask=k_ok[None, :] & dim_ok[:, None],
                        other=0)  # [HEAD_PAD, TILE_N]
            v = tl.load(v_rows[:, None] + dims[None, :],
                        mask=k_ok[:, None] & dim_ok[None, :],
                        other=0)  # [TILE_N, HEAD_PAD]
            # auto: only the interpreter's bf16 upcast
            k = _dequantize(k, KV_FORMAT, q.dtype)
            v = _dequantize(v, KV_FORMAT, q.dtype)
        # --8<-- [end:tile_addresses]

        if INT4:  # q . k = s_j (q_lo . k_lo + q_hi . k_hi) + z_j sum_d q_d
            s = tl.dot(q_lo, _nibbles(k, False, q.dtype), input_precision=DOT_PRECISION)
            s += tl.dot(q_hi, _nibbles(k, True, q.dtype), input_precision=DOT_PRECISION)
            k_s = _load_scales(k_scale_ptr, block, slot, kv_head, stride_sb, stride_ss,
                               stride_sh, k_ok)
            k_z = _load_scales(k_scale_ptr, block, slot, kv_head, stride_sb, stride_ss,
                               stride_sh, k_ok, 1)
            s = (s * k_s[None, :] + q_sum[:, None] * k_z[None, :]) * qk_scale
        else:
            s = tl.dot(q, k, input_precision=DOT_PRECISION)  # [BLOCK_M, TILE_N]
            s = s * qk_scale
            if PER_TOKEN:  # each key column times its own scale
                s = s * _load_scales(k_scale_ptr, block, slot, kv_head, stride_sb,
                                     stride_ss, stride_sh, k_ok)[None, :]
        visible = row_ok[:, None] & k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if SLIDING:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no -inf - -inf
        alpha = tl.exp2(m_i - m_safe)  # rescales what was summed against the old max
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if INT4:  # sum_j p_j z_j: V's zeros, one number per row (p of masked keys is 0)
            acc_zero = acc_zero * alpha + tl.sum(
                p * _load_scales(v_scale_ptr, block, slot, kv_head, stride_sb, stride_ss,
                                 stride_sh, k_ok, 1)[None, :], axis=1)
        if PER_TOKEN:  # sum_j p_j (s_j v_j) = sum_j (p_j s_j) v_j; l keeps the unscaled p
            p = p * _load_scales(v_scale_ptr, block, slot, kv_head, stride_sb, stride_ss,
                                 stride_sh, k_ok)[None, :]
        p = p.to(q.dtype)
        if INT4:
            acc_lo = acc_lo * alpha[:, None] + tl.dot(p, _nibbles(v, False, q.dtype),
                                                      input_precision=DOT_PRECISION)
            acc_hi = acc_hi * alpha[:, None] + tl.dot(p, _nibbles(v, True, q.dtype),
                                                      input_precision=DOT_PRECISION)
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new
    # --8<-- [end:tile_loop]

    # --8<-- [start:finish]
    if NUM_SPLITS == 1:
        dst = out_ptr + token * stride_ot + head * stride_oh  # [BLOCK_M]: each row's start
        factor = 1.0 / tl.where(l_i > 0, l_i, 1.0)  # no key seen (padding rows): acc = 0
    else:  # a partial: every split writes one, even an empty one (m = -inf, l = 0, acc = 0)
        part = (token * tl.num_programs(1) * GROUP + head) * NUM_SPLITS + split  # [BLOCK_M]
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)
        dst = part_acc_ptr + part * HEAD_PAD  # [BLOCK_M]
        factor = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    if FP8:
        # sum_j p_j (v_scale v_j) = v_scale sum_j p_j v_j
        factor = factor * tl.load(v_scale_ptr)
    # int4: the halves side by side, element d then d + HEAD_DIM / 2, both plus V's zeros
    if INT4:
        mask = row_ok[:, None] & half_ok[None, :]
        tl.store(dst[:, None] + halves[None, :],
                 ((acc_lo + acc_zero[:, None]) * factor[:, None]).to(dst.dtype.element_ty),
                 mask=mask)
        tl.store(dst[:, None] + HALF + halves[None, :],
                 ((acc_hi + acc_zero[:, None]) * factor[:, None]).to(dst.dtype.element_ty),
                 mask=mask)
    else:
        tl.store(dst[:, None] + dims[None, :],
                 (acc * factor[:, None]).to(dst.dtype.element_ty),
                 mask=row_ok[:, None] & dim_ok[None, :])
    # --8<-- [end:finish]


# --8<-- [start:combine]
@triton.jit
def _combine_splits_kernel(
    out_ptr,  # [T, heads, head_dim]
    part_acc_ptr,  # [T, heads, NUM_SPLITS, HEAD_PAD]
    part_max_ptr,  # [T, heads, NUM_SPLITS]
    part_sum_ptr,  # [T, heads, NUM_SPLITS]
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # NUM_SPLITS rounded up to a power of two
):
    """One (token, head) per program:
    out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < NUM_SPLITS
    dims = tl.arange(0, HEAD_PAD)
    part = (token * tl.num_programs(1) + head) * NUM_SPLITS + splits  # [SPLITS_PAD]
    m = tl.load(part_max_ptr + part, mask=split_ok, other=float("-inf"))
    l_s = tl.load(part_sum_ptr + part, mask=split_ok, other=0.0)
    dim_ok = dims < HEAD_DIM  # a partial's padding columns are never written
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_PAD + dims[None, :],
                  mask=split_ok[:, None] & dim_ok[None, :],
                  other=0.0)  # [SPLITS_PAD, HEAD_PAD]
    m_max = tl.max(m, axis=0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    weight = tl.exp2(m - m_safe)  # 0 for an empty split
    total = tl.sum(l_s * weight, axis=0)
    out = tl.sum(acc * weight[:, None], axis=0)
    out = out / tl.where(total > 0, total, 1.0)  # no key seen (padding rows): out = 0
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims,
             out.to(out_ptr.dtype.element_ty), mask=dim_ok)
# --8<-- [end:combine]


@cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# --8<-- [start:choose_num_splits]
def choose_num_splits(num_seqs: int, num_kv_heads: int, max_query_len: int,
                      max_seq_len: int, num_sms: int = 132) -> int:
    """Flash-decoding's split count: how many programs share one sequence's keys.

    Only batches of decodes split (a prefill brings enough query blocks of its own). Aim
    at PROGRAMS_PER_SM programs per multiprocessor, but never give a split fewer than
    MIN_KEYS_PER_SPLIT keys of the longest context, and never more than MAX_SPLITS
    splits.
    """
    if max_query_len > 1 or num_seqs == 0:
        return 1
    programs = num_seqs * num_kv_heads
    wanted = -(-PROGRAMS_PER_SM * num_sms // programs)  # ceil
    return max(1, min(wanted, max_seq_len // MIN_KEYS_PER_SPLIT, MAX_SPLITS))
# --8<-- [end:choose_num_splits]


def _choose_tiles(max_query_len: int, group: int, head_pad: int, element_size: int = 2):
    """(BLOCK_M, TILE_N, num_warps, num_stages) for the batch's longest query.

    Decodes: the rows of one query's head group, at least 16 (the smallest matrix product).
    Prefills: 128 rows (as many queries as fit, times the group) against tiles of 64 keys, as in
    the FlashAttention tutorial; in between, 64 rows. The interpreter runs whole tiles as numpy
    arrays, where fewer, larger tiles are faster, but the same sizes keep the paths it checks the
    ones the GPU runs.

    fp32 inputs (``element_size`` 4) get at most 64 rows: their tiles take twice the shared
    memory, and 128 rows of a 256-wide head need 209 KiB per program, over the 163 KiB an A100
    allows (``python -m pagedllm.kernels.compile_check`` measures it); 64 rows need 136.5 KiB.
    """
    rows = max(16, triton.next_power_of_2(group))
    want = max_query_len * group
    if want > 64:
        rows = max(rows, 64 if element_size >= 4 else 128)
    elif want > 16:
        rows = max(rows, 64)
    tile_n = 64 if head_pad <= 128 else 32
    if rows >= 128:
        return rows, tile_n, 8, 3
    return rows, tile_n, 4, 3


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float,
                    sliding_window: int | None = None, kv_cache_dtype: str = "auto",
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    *, num_splits: int | None = None, block_m: int | None = None,
                    tile_n: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The twin's op, ``paged_attention_reference``, by one Triton kernel (two when split).

    q [T, heads, head_dim]; k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim];
    block_tables [B, max_blocks] int32; seq_lens [B]; query_start_loc [B + 1] with
    query_start_loc[0] == 0; seq_lens and query_start_loc on the host or on q's device.
    Returns [T, heads, head_dim] in q's dtype; rows past query_start_loc[B] are 0.

    A quantized cache, as ``store_kv`` writes it: kv_cache_dtype and the caches in the format's
    dtype (int4: head_dim / 2 bytes a row), with k_scale, v_scale [1] float32 for fp8, the
    per-token-head scales [num_blocks, block_size, kv_heads] bfloat16 for int8, or the
    per-token-head (scale, zero) pairs [num_blocks, block_size, kv_heads, 2] bfloat16 for int4.

    Keyword-only, for tests and benchmarks (None: the heuristics choose): ``num_splits`` key
    splits (1: single pass; > 1: flash-decoding with its combine kernel, any batch); ``block_m``
    rows per program (a power of two >= 16 and >= the group size); ``tile_n`` keys per tile (a
    power of two >= 16); ``out`` a [T, heads, head_dim] tensor to write into (every row of it is
    written) and return.
    """
    T, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = block_tables.shape[0]
    # Maxima for the heuristics: exact from host copies, else bounds from shapes (no sync).
    if not seq_lens.is_cuda and not query_start_loc.is_cuda and num_seqs > 0:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
        max_seq_len = int(seq_lens.max())
    else:
        max_query_len = max(T - num_seqs + 1, 1)
        max_seq_len = block_tables.shape[1] * block_size
    seq_lens = seq_lens.to(q.device)  # no-ops when already there
    query_start_loc = query_start_loc.to(q.device)
    fmt = kv_cache_format(kv_cache_dtype)
    scales = [s for s in (k_scale, v_scale) if s is not None]
    runner = kernel_runner(_paged_attention_kernel, q, k_cache, v_cache, block_tables, seq_lens,
                           query_start_loc, *scales)
    if runner is None:  # CPU without the interpreter: the twin
        result = paged_attention_reference(q, k_cache, v_cache, block_tables, seq_lens,
                                           query_start_loc, scale, sliding_window,
                                           kv_cache_dtype, k_scale, v_scale)
        return result if out is None else out.copy_(result)
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not split into {num_kv_heads} groups")
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)  # every row is written: no memset
    if T == 0:
        return out
    # The kernel indexes the last dimension (head_dim) with stride 1.
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    block_tables = block_tables.contiguous()  # no-op when already contiguous
    seq_lens, query_start_loc = seq_lens.contiguous(), query_start_loc.contiguous()
    stride_sb = stride_ss = stride_sh = 0
    if fmt.name != "auto":
        if k_cache.dtype != fmt.storage_dtype or k_cache.shape[-1] * fmt.values_per_byte != \
                head_dim:  # (int4 needs an even head_dim)
            raise ValueError(f"a {fmt.name} cache for head_dim {head_dim} holds "
                             f"{fmt.storage_dtype} rows of {head_dim / fmt.values_per_byte:g}, "
                             f"got {k_cache.dtype} rows of {k_cache.shape[-1]}")
        if k_scale is None or v_scale is None:
            raise ValueError(f"kv_cache_dtype {fmt.name!r} needs k_scale and v_scale")
    if fmt.scales == "per_tensor":  # read as bytes, widened in the kernel (module docstring)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    elif fmt.scales == "per_token_head":
        pair = (2,) if fmt.zero_point else ()  # int4: (scale, zero)
        if (k_scale.stride() != v_scale.stride() or k_scale.stride(-1) != 1
                or k_scale.shape != v_scale.shape
                or k_scale.shape != (*k_cache.shape[:3], *pair)):
            raise ValueError(f"k_scale and v_scale: [num_blocks, block_size, kv_heads"
                             f"{', 2' if pair else ''}] tensors of one layout, last dimension "
                             f"contiguous")
        stride_sb, stride_ss, stride_sh = k_scale.stride(0), k_scale.stride(1), k_scale.stride(2)
    else:
        k_scale, v_scale = k_cache, v_cache  # unused pointers
    # int4 multiplies two halves of head_dim, each at least 16 wide (a matrix product's minimum)
    head_pad = max(32 if fmt.values_per_byte > 1 else 16, triton.next_power_of_2(head_dim))
    rows, tile, num_warps, num_stages = _choose_tiles(max_query_len, group, head_pad,
                                                      q.element_size())
    rows = block_m or rows
    tile = tile_n or tile
    if rows < 16 or rows & (rows - 1) or rows < group:
        raise ValueError(f"block_m={rows}: a power of two >= 16 and >= the group size {group}")
    block_q = rows // group
    if num_splits is None:
        sms = _num_sms(q.device.index or 0) if q.is_cuda else 132
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_query_len, max_seq_len, sms)

    if num_splits > 1:
        part_acc = torch.empty(T, num_heads, num_splits, head_pad, device=q.device,
                               dtype=torch.float32)
        part_max = torch.empty(T, num_heads, num_splits, device=q.device, dtype=torch.float32)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # unused
    grid = (T // block_q + num_seqs + 1, num_kv_heads, num_splits)
    runner[grid](
        out, part_acc, part_max, part_sum, q, k_cache, v_cache, k_scale, v_scale, block_tables,
        seq_lens, query_start_loc, scale * LOG2E, num_seqs, T, sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), stride_sb, stride_ss, stride_sh,
        HEAD_DIM=head_dim, HEAD_PAD=head_pad, BLOCK_SIZE=block_size, GROUP=group,
        BLOCK_M=rows, BLOCK_Q=block_q, TILE_N=tile, NUM_SPLITS=num_splits,
        SLIDING=sliding_window is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_F32=q.dtype == torch.bfloat16 and interpreting(),
        KV_FORMAT=fmt.name,
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        combine = kernel_runner(_combine_splits_kernel, out, part_acc)
        combine[(T, num_heads)](
            out, part_acc, part_max, part_sum, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_PAD=head_pad, NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits), num_warps=4,
        )
    return out
