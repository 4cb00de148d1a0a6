"""Attention over the paged KV cache: the reference definition the Triton kernel must match.

One step of the engine computes a flat batch of query rows from many sequences: a decode
contributes its newest token, a prefill its whole prompt, a chunked prefill one chunk, a prompt
found in the prefix cache only its uncached tail. The rows of sequence b are
``query_start_loc[b]:query_start_loc[b + 1]`` and they are its *last* tokens: with seq_len
tokens in the cache (the new ones already stored), query row i of a sequence with q_len rows
sits at position seq_len - q_len + i. Each query attends causally by position to the
sequence's cached keys, which live in blocks listed by its block table.

This definition gathers each sequence's blocks into one dense run and attends as usual: easy to
read and to check. A kernel never materialises the gather; it walks the block table and reads
the blocks in place, one tile at a time (lessons: the PagedAttention kernel, FlashAttention).
"""

import torch

from .kv_quant import dequantize_kv, kv_cache_format


# --8<-- [start:causal_attention]
def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """softmax(q·kᵀ · scale + mask) · v.

    q: [T, heads, head_dim] queries; k, v: [S, kv_heads, head_dim] the keys and values
    they may attend to; q_positions [T], k_positions [S]. A query at position p sees
    keys at positions <= p (causal) and, with a sliding window w (Mistral), only
    those > p - w.
    Returns [T, heads, head_dim].
    """
    T, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    # --8<-- [start:gqa_layout]
    # Grouped-query attention: each K/V head serves a group of num_heads // num_kv_heads
    # query heads. Laying the queries out as [kv_heads, group * T, head_dim] lets every
    # query of a group meet its K/V head in one matrix product, without copying K/V once
    # per query head.
    group = num_heads // num_kv_heads
    # [kv_heads, group, T, head_dim]
    q = q.view(T, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    q = q.reshape(num_kv_heads, group * T, head_dim)
    scores = torch.bmm(q, k.permute(1, 2, 0)) * scale  # [kv_heads, group * T, S]
    # --8<-- [end:gqa_layout]
    visible = k_positions[None, :] <= q_positions[:, None]  # [T, S]
    if sliding_window is not None:
        visible &= k_positions[None, :] > q_positions[:, None] - sliding_window
    scores = scores.masked_fill(~visible.repeat(group, 1), float("-inf"))
    # [kv_heads, group * T, S]
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    out = torch.bmm(probs, v.transpose(0, 1))  # [kv_heads, group * T, head_dim]
    return out.view(num_kv_heads, group, T, head_dim).permute(2, 0, 1, 3).reshape(
        T, num_heads, head_dim)  # [T, heads, head_dim]
# --8<-- [end:causal_attention]


# --8<-- [start:gather]
def gather_kv(cache: torch.Tensor, block_table: torch.Tensor,
              seq_len: int) -> torch.Tensor:
    """cache [num_blocks, block_size, kv_heads, head_dim] -> this sequence's
    [seq_len, kv_heads, head_dim], in position order."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)  # ceil: entries past them are padding
    # [num_blocks, block_size, kv_heads, head_dim]
    blocks = cache[block_table[:num_blocks]]
    return blocks.flatten(0, 1)[:seq_len]  # slots past seq_len are never read
# --8<-- [end:gather]


# --8<-- [start:read_kv]
def read_kv(cache: torch.Tensor, scales: torch.Tensor | None, block_table: torch.Tensor,
            seq_len: int, kv_cache_dtype: str, dtype: torch.dtype) -> torch.Tensor:
    """gather_kv, then dequantized: this sequence's [seq_len, kv_heads, head_dim] in
    dtype."""
    rows = gather_kv(cache, block_table, seq_len)  # [seq_len, kv_heads, stored]
    if kv_cache_format(kv_cache_dtype).scales == "per_token_head":
        # [seq_len, kv_heads]: the rows' own scales
        scales = gather_kv(scales, block_table, seq_len)
    return dequantize_kv(rows, scales, kv_cache_dtype, dtype)
# --8<-- [end:read_kv]


# --8<-- [start:paged_attention]
def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float,
                    sliding_window: int | None = None, kv_cache_dtype: str = "auto",
                    k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Varlen attention of a flat batch of queries over the paged cache: decodes batched
    together (decode_attention), prompts and chunks one sequence at a time.

    q [T, heads, head_dim]; k_cache, v_cache
    [num_blocks, block_size, kv_heads, head_dim] with this step's K/V already stored
    (store_kv); block_tables [B, max_blocks] int32 (padding entries are never read);
    seq_lens [B] tokens in the cache per sequence, the new ones included;
    query_start_loc [B + 1] int32. Returns [T, heads, head_dim].

    seq_lens and query_start_loc only give loop bounds here: pass them on the CPU (the
    step's inputs keep a host copy) and the loop costs no device synchronisation.

    A quantized cache (kv_cache_dtype, with store_kv's k_scale / v_scale) is dequantized
    as it is read: only the rows a sequence attends to, never the whole pool.
    """
    quant = (kv_cache_dtype, k_scale, v_scale)
    # [T, heads, head_dim]; padding rows past the last sequence stay 0
    out = torch.zeros_like(q)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    decodes = [b for b in range(len(lens)) if starts[b + 1] - starts[b] == 1]
    # decodes, one query each: all of them at once (the common case of a busy engine)
    if decodes:
        rows = torch.tensor([starts[b] for b in decodes], device=q.device)
        out[rows] = decode_attention(q[rows], k_cache, v_cache, block_tables[decodes],
                                     seq_lens[decodes].to(q.device), scale,
                                     sliding_window, *quant)
    for b, seq_len in enumerate(lens):  # prompts and chunks: one sequence at a time
        q_len = starts[b + 1] - starts[b]
        if q_len <= 1:
            continue
        rows = slice(starts[b], starts[b + 1])
        keys, values = (read_kv(cache, scales, block_tables[b], seq_len, kv_cache_dtype,
                                q.dtype)
                        for cache, scales in ((k_cache, k_scale), (v_cache, v_scale)))
        k_positions = torch.arange(seq_len, device=q.device)  # [seq_len]
        # the queries are the last q_len tokens
        q_positions = k_positions[seq_len - q_len:]
        out[rows] = causal_attention(q[rows], keys, values, q_positions, k_positions,
                                     scale, sliding_window)
    return out
# --8<-- [end:paged_attention]


# --8<-- [start:decode_attention]
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     sliding_window: int | None = None, kv_cache_dtype: str = "auto",
                     k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence, each at position seq_len - 1: q [B, heads, head_dim].

    Reads every sequence's keys at once through the slot of each key position, [B, L]
    slots with L = max_blocks * block_size, and masks the positions past each sequence's
    length.
    Returns [B, heads, head_dim].
    """
    B, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    positions = torch.arange(block_tables.shape[1] * block_size, device=q.device)  # [L]
    # [B, L]: the slots each sequence filled
    visible = positions[None, :] < seq_lens[:, None]
    if sliding_window is not None:
        visible &= positions[None, :] > seq_lens[:, None] - 1 - sliding_window
    # The slot of key position p: the block table's entry for p's block, then p's offset
    # in it.
    slots = (block_tables.long()[:, positions // block_size] * block_size
             + positions % block_size)
    # Positions a sequence never filled read its first slot instead: masked below, and
    # never a stale value (a NaN there times a zero probability would still be NaN).
    slots = torch.where(visible, slots, slots[:, :1])  # [B, L]
    # Per K/V head, the slots' rows: [kv_heads, B, L, head_dim], each row one contiguous
    # read (and dequantized, with the slots' own scales for int8 / int4).
    per_row = kv_cache_format(kv_cache_dtype).scales == "per_token_head"

    def read(cache, scales):
        rows = cache.view(-1, num_kv_heads, cache.shape[-1]).transpose(0, 1)[:, slots]
        if per_row:
            # [kv_heads, B, L], int4: [kv_heads, B, L, 2]
            scales = scales.view(-1, *scales.shape[2:]).transpose(0, 1)[:, slots]
        return dequantize_kv(rows, scales, kv_cache_dtype, q.dtype)

    keys, values = read(k_cache, k_scale), read(v_cache, v_scale)
    # [kv_heads, B, group, head_dim]
    q = q.view(B, num_kv_heads, group, head_dim).transpose(0, 1)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [kv_heads, B, group, L]
    scores = scores.masked_fill(~visible[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
    out = torch.matmul(probs, values)  # [kv_heads, B, group, head_dim]
    return out.transpose(0, 1).reshape(B, num_heads, head_dim)
# --8<-- [end:decode_attention]
