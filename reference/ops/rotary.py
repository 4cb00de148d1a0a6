"""Rotary position embeddings (RoPE), applied to the step's queries and keys.

RoPE encodes a token's position by rotating pairs of query/key features through angles
position × frequency. Only the *difference* of two positions survives in q·k, so a key rotated
once, when it was computed, stays valid forever: that is what makes K cacheable. The
frequencies (with Llama 3's or linear scaling) come from the model (``model/rope.py``); this op
only rotates, in the "rotate half" layout of Hugging Face's Llama.
"""

import torch


# --8<-- [start:rotary]
def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
           inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, heads, head_dim] and k [T, kv_heads, head_dim] by positions [T]."""
    # [T, head_dim / 2]
    angles = positions[:, None].float() * inv_freq.to(positions.device)[None, :]
    angles = torch.cat([angles, angles], dim=-1)  # [T, head_dim]
    cos = angles.cos()[:, None, :]  # [T, 1, head_dim]
    sin = angles.sin()[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        first, second = x.chunk(2, dim=-1)  # [T, heads, head_dim/2] each
        rotated_half = torch.cat([-second, first], dim=-1)  # [T, heads, head_dim]
        return x * cos.to(x.dtype) + rotated_half * sin.to(x.dtype)

    return rotate(q), rotate(k)
# --8<-- [end:rotary]
