"""Exercise (lesson 18, "Quantizing the weights"): int4 weights in groups, with a scale and a
zero point per group, two codes a byte.

A linear layer's weight W is [out, in]: row n holds the weights output n multiplies its inputs
by. int4 cuts every row into groups of group_size consecutive inputs. Each group keeps its own
scale s and zero point z, and each weight becomes a 4-bit code q in 0..15 with

    W ~ (q - 8) * s + z

(torch's weight-only int4 kernels read this layout; z is the value code 8 stands for). Compute
in float32 (weight.float()); s and z are *stored* in the weight's dtype:

    lo, hi = the group's min and max
    s      = (hi - lo) / 15, at least 1e-12 (a group of equal values), rounded to weight.dtype
    z      = lo + 8 * s, with s as stored, rounded to weight.dtype
    q      = torch.round((w - z) / s) + 8, with s and z as stored, clipped to [0, 15]

    packed: uint8 [out, in / 2], two codes a byte: byte i of a row holds the code of input 2i
    in its low 4 bits and the code of input 2i + 1 in its high 4 bits
    scales, zeros: [out, in / group_size], in weight.dtype

A group size that does not divide the input size is refused with a ValueError that names both.

Write both functions. Check your work with

    pytest lessons/exercises/test_weight_quant_exercise.py

The test compares your codes, scales and zeros with the reference's (quantize_int4 and
dequantize_weight in reference/ops/weight_quant.py) bit for bit, checks the packing on a weight
with known codes, the round trip (off by at most half a step, s / 2), a group of equal values,
an outlier that must stay in its own group, the refusal, and runs your bytes through torch's
int4 kernel. Until you edit this file the test reports your version as skipped and checks only
the solution.
"""

import torch


def quantize_int4(weight: torch.Tensor,
                  group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [out, in] (float32 or bfloat16) -> (packed, scales, zeros), as the docstring
    above says: packed uint8 [out, in / 2]; scales and zeros [out, in / group_size] in
    weight.dtype."""
    # 1. Refuse a group size that does not divide the input size (ValueError naming both).
    # 2. View the rows as [out, groups, group_size] in float32; each group's min and max.
    # 3. The scale, clamped to at least 1e-12 and rounded to weight.dtype (then back to
    #    float32: quantize with what is stored). The zero from the stored scale, rounded too.
    # 4. The codes: torch.round((w - z) / s) + 8, clipped to [0, 15], as uint8 [out, in].
    # 5. Pack: even inputs (codes[:, 0::2]) in the low nibble, odd ones shifted left by 4.
    raise NotImplementedError("exercise: implement quantize_int4")


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(packed, scales, zeros) as quantize_int4 returns them -> the weight [out, in] the codes
    stand for, computed in float32 and returned in dtype."""
    # Unpack: packed & 0xF is the even input, packed >> 4 the odd one; interleave them back
    # into [out, in]. Then (q - 8) * s + z per group, in float32, and convert to dtype.
    raise NotImplementedError("exercise: implement dequantize_int4")
