"""Solution to lesson 17's exercise: int8 rows with a bfloat16 scale, int4 rows with a bfloat16
scale and zero, as reference/ops/kv_quant.py defines them (quantize_per_token_head,
dequantize_per_token_head)."""

import torch


def quantize_rows(x: torch.Tensor, kv_cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (data, scales): int8 [..., head_dim] and a scale [...], or uint8
    [..., head_dim / 2] and (scale, zero) [..., 2]; scales in bfloat16."""
    x = x.float()
    if kv_cache_dtype == "int8":  # symmetric: -127 .. 127 times the scale
        scale = (x.abs().amax(dim=-1) / 127).to(torch.bfloat16)  # what the cache stores
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # zeros: any scale will do
        q = torch.floor(x / scale.float()[..., None] + 0.5).clamp(-127, 127)
        return q.to(torch.int8), scale
    low = x.amin(dim=-1)  # int4, asymmetric: min + 0 .. 15 times the scale
    scale = ((x.amax(dim=-1) - low) / 15).to(torch.bfloat16)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a row of equal values
    zero = low.to(torch.bfloat16)
    q = torch.floor((x - zero.float()[..., None]) / scale.float()[..., None] + 0.5).clamp(0, 15)
    nibbles = q.to(torch.uint8)  # [..., head_dim], each in 0..15
    half = x.shape[-1] // 2
    packed = nibbles[..., :half] | (nibbles[..., half:] << 4)  # [..., head_dim / 2]
    return packed, torch.stack([scale, zero], dim=-1)


def dequantize_rows(data: torch.Tensor, scales: torch.Tensor, kv_cache_dtype: str,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(data, scales) -> x_hat [..., head_dim] in dtype."""
    if kv_cache_dtype == "int8":
        return (data.float() * scales.float()[..., None]).to(dtype)
    q = torch.cat([data & 0xF, data >> 4], dim=-1).float()  # low nibbles: the first half
    scale, zero = scales.float().unbind(-1)
    return (q * scale[..., None] + zero[..., None]).to(dtype)
