"""Paged attention and rotary for the CPU backend: the decode kernel, or a vectorized torch path.

On CUDA (or on the CPU under ``TRITON_INTERPRET=1``) the tier runs ``kernels.paged_attention``:
one kernel for every query shape. On a CPU without the interpreter, Triton cannot run, and the
reference's definition loops over the prompts and chunks of a step one sequence at a time. The
CPU backend's op (``cpu_paged_attention``, ``backend.py``'s ``CPU_BACKEND``) has no loop over
sequences:

- A step of decodes only goes to the CPU kernel (``kernels/cpu/paged_attention.cpp``), which
  reads each sequence's keys and values in place through its block table: no gather, no
  padding, no mask, float32 scores and softmax.
- Any other step (prompts, chunks, a quantized cache) attends to a few *padded batches* of
  sequences, each one gather of whole blocks and one fused attention product, whatever the
  step's mix. The decodes are split into a few buckets of similar lengths (a padded batch reads
  every sequence's keys up to the longest one's length; with lengths spread from tens to
  hundreds of tokens, most of one batch's reads would be padding); the sequences with more
  than one query row are bucketed the same way, apart from the decodes, their queries padded to
  the longest of their bucket.

What to gather and what to mask depends only on the step's metadata, not on the layer, so it is
worked out once per step, as an ``AttentionPlan``, and reused by every layer: vLLM's backends
likewise turn the step's common metadata into their own once per step (a metadata builder).
The op keeps its twin's signature (a wrapper, a timer, a failing op in a test all call it as
the reference's), so the plan is kept beside the step's host lengths tensor, which every layer
of a step is handed: the first layer plans, the others find the plan there (``StepPlans``).
Rotary's tables are kept the same way, beside the step's positions. The op is held to the
reference by the same tests as the kernel (``tests/unit/test_paged_attention.py``).

Gathers are of whole blocks (``index_select`` of [block_size, kv_heads, head_dim] chunks), not
of single slots: on a CPU, copying a few large contiguous chunks is several times faster than
an indexed copy of one short row per key.
"""

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm.kernels.cpu_ops import FLOATS, CpuOp, cpu_kernels, rotary_with_tables
from pagedllm.reference.ops import dequantize_kv, kv_cache_format


# --8<-- [start:step_plans]
class StepPlans:
    """What a step computes once for all its layers, kept beside a tensor of the step.

    Every layer of a step is handed the same host lengths tensor and the same
    positions; a value derived from them is computed by the first layer that asks and
    found by the others. The entries live as long as that tensor (a weak reference: the
    next step's tensor starts afresh), and the key holds the other inputs by identity
    and version, so a tensor changed in place, or another table, is never served a
    stale value. A step may keep several (a hybrid model's groups: their own block
    tables; its local and global layers: their own rotary frequencies), each made
    once."""

    def __init__(self):
        # (anchor's and inputs' identities and versions) -> (ref, inputs, value)
        self.entries: dict[tuple, tuple] = {}

    def get(self, anchor: torch.Tensor, inputs: tuple, make):
        tensors = [x for x in (anchor, *inputs) if isinstance(x, torch.Tensor)]
        if any(x.is_inference() for x in tensors):
            return make()  # made in inference mode: no version counter to trust
        key = tuple((id(x), x._version) if isinstance(x, torch.Tensor) else x
                    for x in (anchor, *inputs))
        found = self.entries.get(key)
        if found is None or found[0]() is not anchor:
            ref = weakref.ref(anchor, lambda _: self.entries.pop(key, None))
            # inputs kept alive with the entry: no other tensor can take their ids
            found = self.entries[key] = (ref, inputs, make())
        return found[2]


PLANS, TABLES = StepPlans(), StepPlans()
# --8<-- [end:step_plans]


# --8<-- [start:cpu_paged_attention]
@CpuOp
def cpu_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                        scale, sliding_window=None, kv_cache_dtype="auto", k_scale=None,
                        v_scale=None) -> torch.Tensor:
    """The reference op's result, q [T, heads, head_dim] -> [T, heads, head_dim]: a
    step of decodes over an unquantized cache in the CPU kernel, reading the blocks in
    place; any other step by the padded batches of its plan (once per step and
    window)."""
    kernels = cpu_kernels()
    if (kernels is not None and kv_cache_dtype == "auto" and k_scale is None
            and q.dtype == k_cache.dtype and q.dtype in FLOATS
            and q.shape[-1] in (32, 64)
            and _decodes_only(query_start_loc, q.shape[0])):
        return kernels.paged_decode_attention(  # [S, heads, head_dim]
            q.contiguous(), k_cache, v_cache, block_tables, seq_lens, scale,
            sliding_window or 0)
    plan = PLANS.get(seq_lens, (block_tables, query_start_loc, k_cache.shape[1],
                                sliding_window),
                     lambda: plan_attention(block_tables, seq_lens, query_start_loc,
                                            k_cache.shape[1], sliding_window))
    return attend(plan, q, k_cache, v_cache, scale, kv_cache_dtype, k_scale, v_scale)


def _decodes_only(query_start_loc: torch.Tensor, num_rows: int) -> bool:
    """One query row per sequence, and every row a sequence's."""
    every = torch.arange(num_rows + 1, dtype=query_start_loc.dtype)
    return query_start_loc.numel() == num_rows + 1 and bool(
        torch.equal(query_start_loc.cpu(), every))
# --8<-- [end:cpu_paged_attention]


# --8<-- [start:plan]
@dataclass
class PaddedBatch:
    """P sequences attended together, each padded to Q query rows and L = width x block_size
    key positions."""

    rows: torch.Tensor  # [P, Q] the queries' rows in q; a padding row repeats a real one
    real: torch.Tensor | None  # [P, Q] bool, the rows that are real queries; None: all are
    blocks: torch.Tensor  # [P * width] int64, each sequence's blocks (padding: its first)
    unfilled: torch.Tensor  # [U] int64, gathered key positions (p * L + l) past the seq's length
    visible: torch.Tensor  # [P, 1, Q, L] bool: which keys each query may read (any head)
    hidden: torch.Tensor  # ~visible, the mask a decode's scores take: once per step


@dataclass
class AttentionPlan:
    batches: list[PaddedBatch]  # a step's query rows, each in exactly one batch
    # one batch holding rows 0..T-1 in order, unpadded (one sequence, or decodes of one
    # length bucket in order): its result is the output as it is
    in_order: bool = False


def plan_attention(block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   query_start_loc: torch.Tensor, block_size: int,
                   sliding_window: int | None = None) -> AttentionPlan:
    """The step's padded batches: the decodes in buckets of similar length, then the prompts
    and chunks in buckets of their own."""
    starts = query_start_loc.to("cpu", torch.int64)  # [B + 1]
    q_lens = starts[1:] - starts[:-1]  # [B]
    seq_lens = seq_lens.to("cpu", torch.int64)
    block_tables = block_tables.to("cpu", torch.int64)
    batches = []
    decodes = (q_lens == 1).nonzero()[:, 0]  # [D]
    for bucket in length_buckets(seq_lens[decodes].tolist()):
        seqs = decodes[bucket]
        batches.append(_padded_batch(block_tables[seqs], seq_lens[seqs], starts[seqs],
                                     q_lens[seqs], block_size, sliding_window))
    longer = (q_lens > 1).nonzero()[:, 0]  # [P]
    for bucket in length_buckets(seq_lens[longer].tolist()):
        seqs = longer[bucket]
        batches.append(_padded_batch(block_tables[seqs], seq_lens[seqs], starts[seqs],
                                     q_lens[seqs], block_size, sliding_window))
    only = batches[0] if len(batches) == 1 else None
    in_order = only is not None and only.real is None and bool(
        torch.equal(only.rows.reshape(-1), torch.arange(only.rows.numel())))
    return AttentionPlan(batches, in_order)


def _padded_batch(block_tables, seq_lens, starts, q_lens, block_size, sliding_window):
    Q = int(q_lens.max())  # P sequences of up to Q query rows
    width = -(-int(seq_lens.max()) // block_size)  # the longest sequence's blocks
    tables = block_tables[:, :width]  # [P, width]
    used = torch.arange(width)[None, :] * block_size < seq_lens[:, None]  # [P, width]
    tables = torch.where(used, tables, tables[:, :1])  # padding entries read a held block
    i = torch.arange(Q)  # [Q]
    real = i[None, :] < q_lens[:, None]  # [P, Q]
    rows = torch.where(real, starts[:, None] + i[None, :], starts[:, None])  # [P, Q]
    q_pos = (seq_lens - q_lens)[:, None] + i[None, :]  # [P, Q]: each query's position
    positions = torch.arange(width * block_size)  # [L] key positions
    filled = positions[None, :] < seq_lens[:, None]  # [P, L]
    visible = (positions[None, None, :] <= q_pos[:, :, None]) & filled[:, None, :]  # [P, Q, L]
    if sliding_window is not None:
        visible &= positions[None, None, :] > q_pos[:, :, None] - sliding_window
    return PaddedBatch(rows=rows, real=None if bool(real.all()) else real,
                       blocks=tables.reshape(-1), unfilled=(~filled).reshape(-1).nonzero()[:, 0],
                       visible=visible[:, None],  # [P, 1, Q, L]: broadcast over the K/V heads
                       hidden=~visible[:, None])


def length_buckets(lens: list[int], slack: float = 2.0) -> list[list[int]]:
    """Indices of lens in groups of similar length: in each group, padding every member to the
    longest costs at most `slack` times the group's real length."""
    buckets: list[list[int]] = []
    total = 0
    for i in sorted(range(len(lens)), key=lens.__getitem__):  # shortest first
        if buckets and lens[i] * (len(buckets[-1]) + 1) <= slack * (total + lens[i]):
            buckets[-1].append(i)
            total += lens[i]
        else:
            buckets.append([i])
            total = lens[i]
    return buckets
# --8<-- [end:plan]


# --8<-- [start:attend]
def attend(plan: AttentionPlan, q: torch.Tensor, k_cache: torch.Tensor,
           v_cache: torch.Tensor, scale: float, kv_cache_dtype: str = "auto",
           k_scale: torch.Tensor | None = None,
           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, heads, head_dim] -> [T, heads, head_dim], one padded batch at a time.

    A quantized cache is dequantized as its blocks are gathered (only the blocks a batch
    reads)."""
    quant = (kv_cache_dtype, k_scale, v_scale)
    if plan.in_order and plan.batches[0].rows.numel() == q.shape[0]:
        result = _attend_batch(plan.batches[0], q, k_cache, v_cache, scale, *quant)
        return result.flatten(0, 1)  # [P * Q = T, heads, hd]: already the rows' order
    out = q.new_zeros(q.shape)  # rows past the plan's last sequence stay 0
    for batch in plan.batches:
        # [P, Q, heads, hd]
        result = _attend_batch(batch, q, k_cache, v_cache, scale, *quant)
        if batch.real is None:
            out.index_copy_(0, batch.rows.reshape(-1), result.flatten(0, 1))
        else:
            out[batch.rows[batch.real]] = result[batch.real]
    return out


def _attend_batch(batch: PaddedBatch, q, k_cache, v_cache, scale, kv_cache_dtype,
                  k_scale, v_scale) -> torch.Tensor:
    P, head_dim = batch.rows.shape[0], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    L = batch.blocks.numel() // P * block_size
    per_row = kv_cache_format(kv_cache_dtype).scales == "per_token_head"

    # One query per sequence in bf16/fp16: _decode_attention.
    decode = batch.rows.shape[1] == 1 and q.dtype != torch.float32

    def gather(cache, scales):  # [P, kv_heads, L, head_dim]
        rows = cache.index_select(0, batch.blocks).view(
            P * L, num_kv_heads, cache.shape[-1])
        if per_row:  # the gathered slots' own scales: [P * L, kv_heads(, 2)]
            scales = scales.index_select(0, batch.blocks).view(P * L, *scales.shape[2:])
        # [P * L, kvh, head_dim]
        rows = dequantize_kv(rows, scales, kv_cache_dtype, q.dtype)
        # Positions past a sequence's length hold whatever was there, even NaN. Masking
        # adds -inf to a score, and NaN + -inf is NaN; a NaN value times its zero
        # probability is NaN too: the unfilled positions are zeroed in the gathered
        # copy.
        rows.index_fill_(0, batch.unfilled, 0.0)
        return rows.view(P, L, num_kv_heads, head_dim).transpose(1, 2)

    keys, values = gather(k_cache, k_scale), gather(v_cache, v_scale)
    queries = q[batch.rows].transpose(1, 2)  # [P, heads, Q, head_dim]
    if decode:
        return _decode_attention(queries, keys, values, batch.hidden, scale)
    # One fused op for scores, mask, softmax and the weighted sum (torch's CPU flash
    # kernel, float32 softmax); query head h reads K/V head h // group (enable_gqa), as
    # in the reference. A padding row repeats a real one, so no row is masked out
    # entirely.
    out = F.scaled_dot_product_attention(  # [P, heads, Q, hd]
        queries, keys, values, attn_mask=batch.visible, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)  # [P, Q, heads, hd]


def _decode_attention(queries, keys, values, hidden, scale) -> torch.Tensor:
    """One query per sequence in bf16/fp16: two batched products, a float32 softmax.

    torch's CPU flash kernel handles a one-row query in these dtypes several times
    slower than this (16 sequences of 64 keys, SmolLM2's heads: 1.3-1.7 ms against
    0.2-0.35 ms on this project's machine, one thread), and a decode step calls it once
    per layer. The query heads that share a KV head are its rows (head h reads KV head
    h // group, as in the reference). The products run in the model's dtype (float32
    sums, each score rounded once to bf16/fp16, the precision of every other product of
    the model); the softmax is float32, as seed 003 asks. Float32 copies of K/V for the
    products would cost more than the flash kernel does."""
    P, heads, _, head_dim = queries.shape
    kv_heads = keys.shape[1]
    grouped = queries.reshape(P, kv_heads, heads // kv_heads, head_dim)
    # [P, kvh, group, L]
    scores = (grouped @ keys.transpose(-1, -2)).float() * scale
    # the keys each query may not read
    scores.masked_fill_(hidden.view(P, 1, 1, -1), float("-inf"))
    out = scores.softmax(-1).to(values.dtype) @ values  # [P, kvh, group, hd]
    return out.view(P, 1, heads, head_dim)  # [P, Q=1, heads, hd]
# --8<-- [end:attend]


# --8<-- [start:cpu_rotary]
@CpuOp
def cpu_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference op's rotation, bit for bit, with cos/sin computed once per step
    (and frequency tensor: the runner gives the layers one when their frequencies are
    equal) where the op recomputes them in every layer; q and k in one pass in the CPU
    kernel."""
    cos, sin = TABLES.get(positions, (inv_freq, q.dtype),
                          lambda: rotary_tables(positions, inv_freq, q.dtype))
    rotated = rotary_with_tables(q, k, cos, sin)
    return rotated or (rotate_half(q, cos, sin), rotate_half(k, cos, sin))
# --8<-- [end:cpu_rotary]


# --8<-- [start:rotary_tables]
def rotary_tables(positions: torch.Tensor, inv_freq: torch.Tensor,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and a signed sin [T, 1, head_dim] in dtype, computed as the op
    (reference/ops/rotary.py) computes them. The op rotates x into x * cos +
    cat(-x2, x1) * sin; cat(-x2, x1) * sin is roll(x) * cat(-sin1, sin2), the same
    products with the sign moved (exact in floating point), in two ops fewer."""
    # [T, head_dim / 2]
    angles = positions[:, None].float() * inv_freq.to(positions.device)[None, :]
    angles = torch.cat([angles, angles], dim=-1)  # [T, head_dim]
    half = angles.shape[-1] // 2
    sin = angles.sin()
    sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
    return angles.cos()[:, None, :].to(dtype), sin[:, None, :].to(dtype)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by the tables: the op's result, bit for bit."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin
# --8<-- [end:rotary_tables]
