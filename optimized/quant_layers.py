"""Linear layers that multiply without expanding the weight: our CPU kernel, or torch's.

The reference's ``QuantizedLinear`` dequantizes its whole weight for every product (the twin's
definition: readable, and as slow as the float model or slower). On a CPU, torch ships
weight-only kernels that read the codes and scale them inside the product:
``aten._weight_int8pack_mm`` (int8 rows, one scale per output channel) and
``aten._weight_int4pack_mm_for_cpu`` (int4 groups). Both take bf16 (or fp16) activations; with
float32 activations they fall back to a path several times slower than a float32 product, so
the runner swaps them in only for a bf16/fp16 model (quantization's default dtype) and leaves
the twin otherwise.

Where the CPU has AVX-512 BF16 and VNNI, a bf16 model's products run on the project's own
kernels instead (``cpu_ops.py``): on SmolLM2's step (``benchmarks/cpu_kernels.py``), int8 rows
2.9x torch's int8 kernel at one row and 2.2x at 16, int4 groups 1.4x torch's int4 kernel at
one row and 1.8x at 16, and bf16 weights (the LM head above all) 3x oneDNN's at one row. A
tied LM head's packed table also serves the input embedding: one copy, as before. A shape
the kernels do not take (outputs not a multiple of 16) stays the twin for int4, whose torch
kernel refuses it too, and torch's kernel for int8.

The twin's layout (``reference/ops/weight_quant.py``) is the kernels': int8 codes with a scale
per row, int4 codes with ``(q - 8) * scale + zero`` per group, scales and zeros in the model's
dtype. Both dequantize and accumulate in float32 and round once to the model's dtype; only the
order of the additions differs, so outputs agree to float32 rounding before that last step.
"""

import torch
from torch import nn

from pagedllm.kernels.quant_linear import quant_linear
from pagedllm.reference.model.quantization import QuantizedLinear, decoder_stack

from pagedllm.kernels.cpu_ops import cpu_kernels, pack_bf16, pack_int4, pack_int8, packable, unpack_bf16_rows

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


class PackedInt4Linear(nn.Module):
    """int4 groups on our kernel: the codes become bf16 in the registers (csrc/cpu_ops.cpp)."""

    def __init__(self, layer: QuantizedLinear, kernels):
        super().__init__()
        packed, scales, zeros = pack_int4(layer.quantized)
        self.register_buffer("packed", packed)  # [out / 16, in / 4, 32] uint8
        self.register_buffer("scales", scales)  # [out / 16, G, 16] bf16
        self.register_buffer("zeros", zeros)  # [out / 16, G, 16] bf16
        self.group_size, self.bias, self.kernels = layer.quantized.group_size, layer.bias, kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.kernels.int4_matmul(x.contiguous(), self.packed, self.scales, self.zeros,
                                       self.group_size)  # [T, out]
        return out if self.bias is None else out + self.bias


class PackedInt8Linear(nn.Module):
    """int8 rows on our kernel: the codes multiplied as they are stored (VNNI), the activations
    as 24-bit integers (csrc/cpu_ops.cpp int8_tile)."""

    def __init__(self, layer: QuantizedLinear, kernels):
        super().__init__()
        packed, scales, qsum = pack_int8(layer.quantized)
        self.register_buffer("packed", packed)  # [out / 16, in / 4, 16, 4] int8
        self.register_buffer("scales", scales)  # [out] float32, the twin's, exactly
        self.register_buffer("qsum", qsum)  # [out] int32
        self.bias, self.kernels = layer.bias, kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.kernels.int8_matmul(x.contiguous(), self.packed, self.scales,
                                       self.qsum)  # [T, out]
        return out if self.bias is None else out + self.bias


class PackedBF16Linear(nn.Module):
    """A bf16 nn.Linear on our kernel, its weight reshuffled into the kernel's pairs."""

    def __init__(self, layer: nn.Linear, kernels):
        super().__init__()
        self.register_buffer("packed", pack_bf16(layer.weight.detach()))  # [out/16, in/2, 16, 2]
        self.bias, self.kernels = layer.bias, kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.kernels.bf16_matmul(x.contiguous(), self.packed)  # [T, out]
        return out if self.bias is None else out + self.bias


class PackedEmbedding(nn.Module):
    """An input embedding reading its rows from the tied LM head's packed table."""

    def __init__(self, head: PackedBF16Linear):
        super().__init__()
        self.packed = head.packed  # the head's buffer: one table for both

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return unpack_bf16_rows(self.packed, token_ids)  # [T, hidden]


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


def pack_linears_for_cpu(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Every product as the fastest CPU kernel for its weight, where one is faster than the
    twin: ours for bf16 and int4 weights (AVX-512 BF16), torch's otherwise."""
    if dtype not in FAST_DTYPES:
        return model
    kernels = cpu_kernels() if dtype == torch.bfloat16 else None
    stack, head = decoder_stack(model), model.lm_head
    tied = isinstance(head, nn.Linear) and \
        head.weight.data_ptr() == stack.embed_tokens.weight.data_ptr()
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, QuantizedLinear):
                q = child.quantized
                own = {"int8": PackedInt8Linear, "int4": PackedInt4Linear}[q.scheme]
                if kernels and packable(*q.shape):
                    setattr(parent, name, own(child, kernels))
                elif q.scheme == "int8":
                    setattr(parent, name, Int8PackedLinear(child, dtype))
                elif packable(*q.shape):  # torch's int4 packing takes 16 outputs at a time
                    setattr(parent, name, Int4PackedLinear(child, dtype))
                # else: the twin, which takes any shape
            elif isinstance(child, nn.Linear) and kernels and packable(*child.weight.shape):
                setattr(parent, name, PackedBF16Linear(child, kernels))
    if tied and isinstance(model.lm_head, PackedBF16Linear):
        stack.embed_tokens = PackedEmbedding(model.lm_head)
    return model
