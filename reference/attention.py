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
