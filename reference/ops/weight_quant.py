"""Weight-only quantization: what an int8, fp8 or int4 linear layer stores, and its matrix product.

A decode step multiplies a few rows by every weight of the model, so its time is the time to
read the weights: fewer bytes per weight, a faster step (and a model that fits). Only the
weights of the linear layers are quantized; activations, norms, the softmax and the logits stay
in the model's dtype, as seed 003 recommends (bf16 activations with int4/int8 weights).

- **int8, per output channel, symmetric** (torchao's int8 weight-only): row n of W [out, in]
  keeps one scale s_n = max|W_n| / 127 and stores round(W_n / s_n) in [-127, 127]; 1 byte a
  weight plus one scale a row.
- **fp8 (e4m3), per output channel** (vLLM's ``quantization="fp8"`` for a checkpoint without a
  quantization config, weight-only as its Marlin path runs it on an A100): row n keeps one scale
  s_n = max|W_n| / 448 and stores W_n / s_n rounded to the nearest e4m3 number (1 sign, 4
  exponent, 3 mantissa bits; largest 448). The same byte a weight as int8, but the levels are
  spaced like the weights themselves, dense near zero and sparse at the edges: a relative error
  of at most 2**-4 per weight instead of int8's uniform step. vLLM's own online form keeps one
  scale per tensor; a scale per row costs 2 bytes more a row and never a larger error.
- **int4, per group, asymmetric** (torchao's int4 weight-only; GGUF's Q4_1 is the same idea):
  each row is cut into groups of ``group_size`` inputs; a group keeps a scale s and a zero
  point z (a float: the value that code 8 stands for) and stores codes q in [0, 15] with
  W ~ (q - 8) s + z. The 16 levels span the group's own range [min, max], which a symmetric
  scale would spend half of on values the group may not have. Two codes a byte (low nibble:
  the even input), plus a scale and a zero point per group.

Scales and zero points are stored in the model's dtype (bf16 for a quantized model on the CPU),
the form the fast kernels read them in: the twin then computes exactly what they compute.

The product is the twin's definition: dequantize, then multiply, in float32.
The optimized tier multiplies without expanding the weight (``optimized/quant_layers.py``).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

WEIGHT_QUANTIZATIONS = ("int8", "int4", "fp8", "gguf")  # gguf: a .gguf file's own 4-bit blocks
FP8_MAX = 448.0  # e4m3's largest magnitude (torch.float8_e4m3fn: no infinities)
INT4_GROUP_SIZES = (32, 64, 128, 256)


@dataclass
class QuantizedWeight:
    """A quantized [out, in] weight: qweight int8 [out, in] (int8), float8_e4m3fn [out, in]
    (fp8) or uint8 [out, in / 2] (int4, two codes a byte); scales [out] (int8, fp8) or
    [out, in / group_size] (int4) and zeros
    [out, in / group_size] (int4 only), in the weight's dtype."""

    scheme: str
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    shape: tuple[int, int]  # [out, in]
    group_size: int | None = None

    def nbytes(self) -> int:
        parts = (self.qweight, self.scales) + ((self.zeros,) if self.zeros is not None else ())
        return sum(t.numel() * t.element_size() for t in parts)


# --8<-- [start:quantize_weight]
def _tiny(weight: torch.Tensor) -> float:
    """The smallest scale the weight's dtype stores: a constant row's (or group's)."""
    return torch.finfo(weight.dtype).tiny


def quantize_int8(weight: torch.Tensor,
                  absmax: torch.Tensor | None = None) -> QuantizedWeight:
    """W [out, in] -> int8 rows with one symmetric scale per output channel.
    absmax [out]: each row's max |w| when W is a slice of the rows' inputs (a
    tensor-parallel shard), so that the slice gets the whole row's scale."""
    w = weight.detach().float()
    if absmax is None:
        absmax = w.abs().amax(dim=1)  # [out]
    # [out], as stored (the codes are made for it). The floor, the dtype's smallest
    # normal, keeps an all-zero row at 0 / tiny = 0, not 0 / 0 (fp16 rounds 1e-12 to 0).
    scales = (absmax.float() / 127).to(weight.dtype)
    scales = scales.clamp(min=_tiny(weight)).float()
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)  # [out, in]
    return QuantizedWeight("int8", q, scales.to(weight.dtype), None, tuple(w.shape))


def quantize_fp8(weight: torch.Tensor,
                 absmax: torch.Tensor | None = None) -> QuantizedWeight:
    """W [out, in] -> e4m3 rows with one scale per output channel, the row's largest
    |w| landing on e4m3's largest value, 448. absmax [out]: as for int8."""
    w = weight.detach().float()
    if absmax is None:
        absmax = w.abs().amax(dim=1)  # [out]
    # [out], as stored, floored as int8's
    scales = (absmax.float() / FP8_MAX).to(weight.dtype)
    scales = scales.clamp(min=_tiny(weight)).float()
    # [out, in]: torch's conversion rounds to the nearest e4m3 value (ties to even)
    q = (w / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return QuantizedWeight("fp8", q, scales.to(weight.dtype), None, tuple(w.shape))


def quantize_int4(weight: torch.Tensor, group_size: int) -> QuantizedWeight:
    """W [out, in] -> 4-bit codes in groups of group_size inputs, each group with
    its own scale and zero point spanning the group's [min, max]."""
    out, inp = weight.shape
    if inp % group_size:
        raise ValueError(f"int4 groups of {group_size} do not divide an input size "
                         f"of {inp}")
    w = weight.detach().float().view(out, inp // group_size, group_size)  # [out, G, g]
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)  # [out, G]
    scales = ((hi - lo) / 15).to(weight.dtype)  # [out, G]
    scales = scales.clamp(min=_tiny(weight)).float()
    zeros = (lo + 8 * scales).to(weight.dtype).float()  # what code 8 stands for
    q = torch.round((w - zeros[..., None]) / scales[..., None]) + 8  # [out, G, g]
    q = q.clamp(0, 15).to(torch.uint8).view(out, inp)  # [out, in], codes 0..15
    # [out, in / 2]: the even input in the low nibble, the odd one in the high
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    return QuantizedWeight("int4", packed, scales.to(weight.dtype),
                           zeros.to(weight.dtype), (out, inp), group_size)


def dequantize_weight(qw: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The [out, in] weight the codes stand for, computed in float32, in dtype."""
    if qw.scheme in ("int8", "fp8"):
        # a code (an integer or an e4m3 number) times its row's scale
        return (qw.qweight.float() * qw.scales.float()[:, None]).to(dtype)
    out, inp = qw.shape
    nibbles = [qw.qweight & 0xF, qw.qweight >> 4]
    q = torch.stack(nibbles, dim=-1).view(out, inp)  # [out, in]
    q = q.float().view(out, inp // qw.group_size, qw.group_size)  # [out, G, g]
    w = (q - 8) * qw.scales.float()[..., None] + qw.zeros.float()[..., None]
    return w.view(out, inp).to(dtype)
# --8<-- [end:quantize_weight]


# --8<-- [start:quantized_linear]
def quantized_linear(x: torch.Tensor, qw: QuantizedWeight,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] -> [T, out]: the weight dequantized, then an ordinary product, both in
    float32 and rounded once to x's dtype, as the fast kernels accumulate."""
    out = F.linear(x.float(), dequantize_weight(qw, torch.float32))  # [T, out]
    return (out if bias is None else out + bias.float()).to(x.dtype)
# --8<-- [end:quantized_linear]
