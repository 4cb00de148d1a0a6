"""Solution to lesson 18's exercise: int4 weights in groups with a scale and a zero point each,
as reference/ops/weight_quant.py defines them (quantize_int4, dequantize_weight)."""

import torch


def quantize_int4(weight: torch.Tensor,
                  group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (packed uint8 [out, in / 2], scales and zeros [out, in / group_size]
    in weight.dtype), with W ~ (q - 8) * s + z."""
    out, inp = weight.shape
    if inp % group_size:
        raise ValueError(f"int4 groups of {group_size} do not divide an input size of {inp}; "
                         f"choose a group size that divides {inp}")
    w = weight.detach().float().view(out, inp // group_size, group_size)  # [out, G, group]
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)  # [out, G]
    # Stored in the weight's dtype; the codes are made for the stored values, so that the
    # round trip is off by half a step of what the kernels will read.
    # a group of equal values: the dtype's smallest normal (1e-12 would be 0 in fp16)
    tiny = torch.finfo(weight.dtype).tiny
    scales = ((hi - lo) / 15).to(weight.dtype).clamp(min=tiny).float()  # [out, G]
    zeros = (lo + 8 * scales).to(weight.dtype).float()  # [out, G]: what code 8 stands for
    q = torch.round((w - zeros[..., None]) / scales[..., None]) + 8  # [out, G, group]
    codes = q.clamp(0, 15).to(torch.uint8).view(out, inp)  # [out, in], each in 0..15
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # [out, in / 2]: even low, odd high
    return packed, scales.to(weight.dtype), zeros.to(weight.dtype)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(packed, scales, zeros) -> W_hat [out, in] in dtype, computed in float32."""
    out, half = packed.shape
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).view(out, 2 * half)  # [out, in]
    q = codes.float().view(out, -1, group_size)  # [out, G, group]
    w = (q - 8) * scales.float()[..., None] + zeros.float()[..., None]
    return w.view(out, 2 * half).to(dtype)
