"""Paged attention for the optimized tier: the Triton kernel, or a vectorized torch path on the CPU.

On CUDA tensors (or on the CPU under ``TRITON_INTERPRET=1``) this is ``kernels.paged_attention``:
one kernel for every query shape. On a CPU without the interpreter, Triton cannot run, and the
reference's definition loops over the prompts and chunks of a step one sequence at a time. This
path has no loop over sequences: the decodes go through the reference's ``decode_attention`` (all
of them in one batched product), and every sequence with more than one query row goes through
one padded batch — queries padded to the longest, keys read through the slots of each sequence's
block table — so a step costs the same handful of tensor operations whatever its mix.

A decode batch is also split into a few buckets of similar lengths. Batched decode attention
reads every sequence's keys up to the longest one's length (the rest masked); with lengths
spread from tens to hundreds of tokens, most of what it would read is padding, and on a CPU
that read (an indexed copy of K and V) is the largest cost after the weights.

It is held to the reference op by the same tests as the kernel (``tests/test_paged_attention.py``).
"""

import torch

from pagedllm.kernels.paged_attention import paged_attention as triton_paged_attention
from pagedllm.kernels.runtime import interpreting
from pagedllm.reference.ops.attention import decode_attention


# --8<-- [start:dispatch]
def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float,
                    sliding_window: int | None = None) -> torch.Tensor:
    """The reference ``paged_attention``'s signature and result (see reference/ops)."""
    if q.is_cuda or interpreting():
        return triton_paged_attention(q, k_cache, v_cache, block_tables, seq_lens,
                                      query_start_loc, scale, sliding_window)
    return cpu_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                               scale, sliding_window)
# --8<-- [end:dispatch]


def cpu_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                        sliding_window=None) -> torch.Tensor:
    """Decodes in one batch, all longer query runs in one padded batch. Returns [T, heads, hd]."""
    out = torch.zeros_like(q)  # [T, heads, head_dim]; rows past the last sequence stay 0
    starts = query_start_loc.to("cpu", torch.int64)  # [B + 1]
    q_lens = starts[1:] - starts[:-1]  # [B]
    seq_lens = seq_lens.to("cpu", torch.int64)
    decodes = (q_lens == 1).nonzero()[:, 0]  # [D]
    block_size = k_cache.shape[1]
    for bucket in length_buckets(seq_lens[decodes].tolist()):
        seqs = decodes[bucket]
        rows, lens = starts[seqs], seq_lens[seqs]
        width = -(-int(lens.max()) // block_size)  # the bucket's longest sequence's blocks
        out[rows] = decode_attention(q[rows], k_cache, v_cache, block_tables[seqs, :width],
                                     lens, scale, sliding_window)
    longer = (q_lens > 1).nonzero()[:, 0]  # [P]
    if longer.numel():
        rows, result = _padded_attention(q, k_cache, v_cache, block_tables[longer],
                                         seq_lens[longer], starts[longer], q_lens[longer],
                                         scale, sliding_window)
        out[rows] = result
    return out


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


def _padded_attention(q, k_cache, v_cache, block_tables, seq_lens, starts, q_lens, scale,
                      sliding_window):
    """P sequences of several query rows each, padded to the longest: (their rows [R], the
    attention output of those rows [R, heads, head_dim])."""
    P, num_heads, head_dim = len(q_lens), q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    Q = int(q_lens.max())
    i = torch.arange(Q)  # [Q]
    real = i[None, :] < q_lens[:, None]  # [P, Q]: which padded rows are real queries
    rows = torch.where(real, starts[:, None] + i[None, :], starts[:, None])  # [P, Q]
    q_pos = (seq_lens - q_lens)[:, None] + i[None, :]  # [P, Q]: each query's position
    positions = torch.arange(block_tables.shape[1] * block_size)  # [L] key positions
    filled = positions[None, :] < seq_lens[:, None]  # [P, L]
    visible = (positions[None, None, :] <= q_pos[:, :, None]) & filled[:, None, :]  # [P, Q, L]
    if sliding_window is not None:
        visible &= positions[None, None, :] > q_pos[:, :, None] - sliding_window
    slots = block_tables.long()[:, positions // block_size] * block_size + positions % block_size
    slots = torch.where(filled, slots, slots[:, :1])  # [P, L]; unfilled read a filled slot
    keys = k_cache.view(-1, num_kv_heads, head_dim).transpose(0, 1)[:, slots]  # [kvh, P, L, hd]
    values = v_cache.view(-1, num_kv_heads, head_dim).transpose(0, 1)[:, slots]
    qg = q[rows].view(P, Q, num_kv_heads, group, head_dim).permute(2, 0, 3, 1, 4)
    qg = qg.reshape(num_kv_heads, P, group * Q, head_dim)  # [kvh, P, group * Q, hd]
    scores = torch.matmul(qg, keys.transpose(-1, -2)) * scale  # [kvh, P, group * Q, L]
    mask = visible[:, None].expand(P, group, Q, visible.shape[-1]).reshape(P, group * Q, -1)
    scores = scores.masked_fill(~mask[None], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
    out = torch.matmul(probs, values)  # [kvh, P, group * Q, hd]
    out = out.view(num_kv_heads, P, group, Q, head_dim).permute(1, 3, 0, 2, 4)
    out = out.reshape(P, Q, num_heads, head_dim)  # [P, Q, heads, hd]
    return rows[real], out[real]
