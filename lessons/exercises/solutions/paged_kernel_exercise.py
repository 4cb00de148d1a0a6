"""Solution to lesson 10's exercise: decode attention that reads the paged cache in place."""

import torch


def attend_in_place(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_table: list[int], seq_len: int, scale: float) -> torch.Tensor:
    """q [heads, head_dim], the query at position seq_len - 1 -> [heads, head_dim]."""
    heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    kv_of_head = torch.arange(heads) // group  # the K/V head each query head reads
    pieces = []  # per logical block: (physical block, slots in use)
    for logical in range(-(-seq_len // block_size)):
        used = min(block_size, seq_len - logical * block_size)
        pieces.append((int(block_table[logical]), used))

    # Pass 1: scores, block by block. keys[:, kv_of_head] is [used, heads, head_dim].
    scores = []
    for block, used in pieces:
        keys = k_cache[block, :used][:, kv_of_head]  # only this block's filled slots
        scores.append(torch.einsum("hd,nhd->hn", q.float(), keys.float()) * scale)
    probs = torch.softmax(torch.cat(scores, dim=1), dim=1)  # [heads, seq_len]

    # Pass 2: the probability-weighted values, block by block.
    out = torch.zeros(heads, head_dim, dtype=torch.float32)
    start = 0
    for block, used in pieces:
        values = v_cache[block, :used][:, kv_of_head].float()  # [used, heads, head_dim]
        out += torch.einsum("hn,nhd->hd", probs[:, start:start + used], values)
        start += used
    return out.to(q.dtype)
