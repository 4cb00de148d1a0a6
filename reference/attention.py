"""Causal self-attention over whatever keys a cache hands back.

The same function serves every cache: with no cache the keys are the whole sequence, with a
cache they are the stored prefix plus the new tokens. Positions, not tensor indices, decide what
a query may see, so a query at position p attends to keys at positions <= p (causal) and, with a
sliding window w (Mistral), only to keys at positions > p - w.
"""

import torch


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

    q: [T, heads, head_dim] the new tokens' queries; k, v: [S, kv_heads, head_dim] the keys and
    values they may attend to; q_positions [T], k_positions [S]. Returns [T, heads, head_dim].
    """
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    # Grouped-query attention: each K/V head serves num_heads // num_kv_heads query heads.
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)  # [S, heads, head_dim]
    v = v.repeat_interleave(group, dim=1)  # [S, heads, head_dim]

    scores = torch.einsum("thd,shd->hts", q, k) * scale  # [heads, T, S]
    visible = k_positions[None, :] <= q_positions[:, None]  # [T, S]
    if sliding_window is not None:
        visible &= k_positions[None, :] > q_positions[:, None] - sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)  # [heads, T, S]
    return torch.einsum("hts,shd->thd", probs, v)  # [T, heads, head_dim]


# --8<-- [start:attend]
def attend(cache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           positions: torch.Tensor, scale: float,
           sliding_window: int | None = None) -> torch.Tensor:
    """Attention for a flat batch of tokens, one sequence at a time.

    Everything else in a layer works token by token, so tokens of many sequences can be laid
    end to end ([T, ...]); attention alone must stay inside each sequence. ``cache.split(T)``
    says which rows belong to which sequence and gives that sequence's KV cache: store the new
    K/V, fetch everything the queries may see, attend.
    """
    out = torch.empty_like(q)  # [T, heads, head_dim]
    for rows, seq_cache in cache.split(q.shape[0]):
        keys, values, key_positions = seq_cache.store_and_fetch(layer, positions[rows], k[rows],
                                                                v[rows])
        out[rows] = causal_attention(q[rows], keys, values, positions[rows], key_positions,
                                     scale, sliding_window)
    return out
# --8<-- [end:attend]
