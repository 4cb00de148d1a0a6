"""Quantized linear layers that multiply without expanding the weight: torch's CPU kernels.

The reference's ``QuantizedLinear`` dequantizes its whole weight for every product (the twin's
definition: readable, and as slow as the float model or slower). On a CPU, torch ships
weight-only kernels that read the codes and scale them inside the product:
``aten._weight_int8pack_mm`` (int8 rows, one scale per output channel) and
``aten._weight_int4pack_mm_for_cpu`` (int4 groups). Both take bf16 (or fp16) activations; with
float32 activations they fall back to a path several times slower than a float32 product, so
the runner swaps them in only for a bf16/fp16 model (quantization's default dtype) and leaves
the twin otherwise.

The twin's layout (``reference/ops/weight_quant.py``) is the kernels': int8 codes with a scale
per row, int4 codes with ``(q - 8) * scale + zero`` per group, scales and zeros in the model's
dtype. Both dequantize and accumulate in float32 and round once to the model's dtype; only the
order of the additions differs, so outputs agree to float32 rounding before that last step.
"""

import torch
from torch import nn

from pagedllm.kernels.quant_linear import quant_linear
from pagedllm.reference.model.quantization import QuantizedLinear

FAST_DTYPES = (torch.bfloat16, torch.float16)


class Int8PackedLinear(nn.Module):
    def __init__(self, layer: QuantizedLinear, dtype: torch.dtype):
        super().__init__()
        q = layer.quantized
        self.register_buffer("qweight", q.qweight)  # [out, in] int8
        self.register_buffer("scales", q.scales.to(dtype))  # [out]
        self.bias = layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)  # [T, out]
        return out if self.bias is None else out + self.bias


class Int4PackedLinear(nn.Module):
    def __init__(self, layer: QuantizedLinear, dtype: torch.dtype):
        super().__init__()
        q = layer.quantized
        out, inp = q.shape
        codes = torch.stack([q.qweight & 0xF, q.qweight >> 4], dim=-1).view(out, inp)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes.to(torch.int32), 1))  # [out, in / 2], torch's own nibble order
        self.register_buffer("scale_and_zero", torch.stack([q.scales, q.zeros], dim=-1)
                             .transpose(0, 1).contiguous().to(dtype))  # [G, out, 2]
        self.group_size, self.bias = q.group_size, layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.packed, self.group_size, self.scale_and_zero)  # [T, out]
        return out if self.bias is None else out + self.bias


class TritonQuantizedLinear(QuantizedLinear):
    """On CUDA (and under the interpreter): the same codes and scales, multiplied by the Triton
    kernel that dequantizes in registers (``kernels/quant_linear.py``)."""

    def __init__(self, layer: QuantizedLinear):
        super().__init__(layer.quantized, layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quant_linear(x, self.quantized, self.bias)  # [T, out]


def triton_quantized_linears(model: nn.Module) -> nn.Module:
    """Every QuantizedLinear as the Triton kernel's module."""
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, QuantizedLinear):
                setattr(parent, name, TritonQuantizedLinear(child))
    return model


def pack_quantized_linears(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Every QuantizedLinear as torch's packed kernel for its scheme, where they run fast."""
    if dtype not in FAST_DTYPES:
        return model
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, QuantizedLinear):
                packed = Int8PackedLinear if child.quantized.scheme == "int8" else \
                    Int4PackedLinear
                setattr(parent, name, packed(child, dtype))
    return model
