"""Linear layers that multiply without expanding the weight: our CPU kernels, or torch's.

The reference's ``QuantizedLinear`` dequantizes its whole weight for every product (the twin's
definition: readable, and as slow as the float model or slower). The project's own CPU kernels
(``kernels/cpu/quant_linear.cpp``, packed by ``kernels/cpu_ops.py``) read the codes and turn
them into numbers inside the registers, on every CPU the extension builds on: AVX-512 with
BF16 and VNNI, AVX2 with FMA, or portable C++ (the best path the CPU has, chosen at run time).
They take bf16 activations (a bf16 model) and float32 ones (a float32 model: the dtype a CPU
without native bf16 computes in, since emulated bf16 costs more than the bytes it saves).

What ``pack_linears_for_cpu`` swaps in, by the model's dtype:

- **bf16 or float32, the extension built**: int8, int4 and fp8 layers on our kernels
  (``PackedInt8Linear``, ``PackedInt4Linear``, ``PackedFp8Linear``), and for a bf16 model its
  float layers too
  (``PackedBF16Linear``; a tied LM head's packed table also serves the input embedding: one
  copy, as before). A float32 model's float layers stay ``F.linear`` (BLAS is fast there).
- **no extension, or a shape the kernels do not take** (outputs or inputs not a multiple of
  16): torch's weight-only kernels for a bf16/fp16 model, ``aten._weight_int8pack_mm`` (int8
  rows) and ``aten._weight_int4pack_mm_for_cpu`` (int4 groups; its packing takes 16 outputs
  at a time too, so an int4 shape it refuses stays the twin); a float32 model keeps the twin,
  since torch's kernels with float32 activations fall back to a path several times slower
  than a float32 product. An fp16 model always takes torch's kernels (ours take bf16 and
  float32). An fp8 layer without our kernel keeps the twin: torch has no weight-only e4m3
  product on the CPU.

Measured on SmolLM2-135M's decode step (``benchmarks/cpu_kernels.py --model
smollm2-135m-instruct``, one thread, every product of a step one after the other, weights from
memory) on an Intel Xeon (Sapphire Rapids class, 2 cores, busy with other work: ratios are
steadier than the times), float32 activations::

    ms a step (speed against F.linear)    1 row          4 rows         16 rows
    F.linear, float32 weights           45.8           86.5           132.6
    torch int8 / int4 g32 kernels      114 / 252      361 / 973     1401 / 3762  (0.4x-0.04x)
    ours int8, AVX-512 / AVX2      22.3 / 25.5    31.1 / 38.4     60.5 / 84.3  (2.2x / 1.6x)
    ours int4 g32, AVX-512 / AVX2  20.9 / 25.5    31.5 / 39.3     46.6 / 69.7  (2.8x / 1.9x)

(every product of a step, the LM head included; AVX2 is the path an AVX2-only CPU such as AMD
Zen 2 takes, here capped with ``use_isa``). torch's kernels on float32 activations are 2.5 to
25 times slower than F.linear, hence the twin where ours did not build. With bf16 activations
(AVX-512, measured before on an AMD EPYC, Zen 4): int8 rows 2.9x torch's int8 kernel at one row
and 2.2x at 16, int4 groups 1.4x torch's int4 kernel at one row and 1.8x at 16, and bf16
weights (the LM head above all) 3x oneDNN's at one row.

The twin's layout (``reference/ops/weight_quant.py``) is the kernels': int8 codes with a scale
per row, int4 codes with ``(q - 8) * scale + zero`` per group, scales and zeros in the model's
dtype (the int4 kernel reads a float32 model's float32 scales as they are). Both dequantize and
accumulate in float32 and round once to the model's dtype; only the order of the additions
differs, so outputs agree to float32 rounding before that last step.
"""

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels.cpu_ops import (
    cpu_kernels,
    pack_bf16,
    pack_fp8,
    pack_int4,
    pack_int8,
    packable,
    unpack_bf16_rows,
)
from pagedllm.kernels.quant_linear import quant_linear
from pagedllm.reference.model.quantization import QuantizedLinear, decoder_stack

FAST_DTYPES = (torch.bfloat16, torch.float16)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., in] as the kernels' contiguous [T, in] rows."""
    return (x if x.dim() == 2 else x.reshape(-1, x.shape[-1])).contiguous()


def _finish(out: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel's [T, out] back in x's leading shape, plus the bias."""
    if x.dim() != 2:
        out = out.view(*x.shape[:-1], out.shape[-1])  # [..., out]
    return out if bias is None else out + bias


class Int8PackedLinear(nn.Module):
    def __init__(self, layer: QuantizedLinear, dtype: torch.dtype):
        super().__init__()
        q = layer.quantized
        self.register_buffer("qweight", q.qweight)  # [out, in] int8
        self.register_buffer("scales", q.scales.to(dtype))  # [out]
        self.bias = layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int8pack_mm(_rows(x), self.qweight,
                                                 self.scales)  # [T, out]
        return _finish(out, x, self.bias)


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
            _rows(x), self.packed, self.group_size, self.scale_and_zero)  # [T, out]
        return _finish(out, x, self.bias)


class PackedInt4Linear(nn.Module):
    """int4 groups on our kernel: each code becomes a float in the registers
    (kernels/cpu/quant_linear.cpp)."""

    def __init__(self, layer: QuantizedLinear, kernels):
        super().__init__()
        q = layer.quantized
        packed, scales, zeros = pack_int4(q)
        if q.scales.dtype == torch.float32:  # a float32 model's: kept as they are, not bf16
            n, groups = q.scales.shape
            scales, zeros = (t.view(n // 16, 16, groups).transpose(1, 2).contiguous()
                             for t in (q.scales, q.zeros))
        self.register_buffer("packed", packed)  # [out / 16, in / 4, 32] uint8
        self.register_buffer("scales", scales)  # [out / 16, G, 16] bf16 (or float32)
        self.register_buffer("zeros", zeros)  # [out / 16, G, 16] bf16 (or float32)
        self.group_size, self.bias, self.kernels = q.group_size, layer.bias, kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.kernels.int4_matmul(_rows(x), self.packed, self.scales, self.zeros,
                                       self.group_size)  # [T, out]
        return _finish(out, x, self.bias)


class PackedInt8Linear(nn.Module):
    """int8 rows on our kernel: the codes multiplied as they are stored (AVX-512: VNNI, the
    activations as 24-bit integers; otherwise each code a float in the registers)."""

    def __init__(self, layer: QuantizedLinear, kernels):
        super().__init__()
        packed, scales, qsum = pack_int8(layer.quantized)
        self.register_buffer("packed", packed)  # [out / 16, in / 4, 16, 4] int8
        self.register_buffer("scales", scales)  # [out] float32, the twin's, exactly
        self.register_buffer("qsum", qsum)  # [out] int32
        self.bias, self.kernels = layer.bias, kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.kernels.int8_matmul(_rows(x), self.packed, self.scales,
                                       self.qsum)  # [T, out]
        return _finish(out, x, self.bias)


class PackedFp8Linear(nn.Module):
    """fp8 (e4m3) rows on our kernel: each code an fp16 number by a shift and an AND, widened
    to float32 in the registers, multiplied in float32 (kernels/cpu/quant_linear.cpp)."""

    def __init__(self, layer: QuantizedLinear, kernels):
        super().__init__()
        packed, scales = pack_fp8(layer.quantized)
        self.register_buffer("packed", packed)  # [out / 16, in, 16] uint8 (e4m3 bits)
        self.register_buffer("scales", scales)  # [out] float32, the twin's (NaN: a NaN code)
        self.bias, self.kernels = layer.bias, kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.kernels.fp8_matmul(_rows(x), self.packed, self.scales)  # [T, out]
        return _finish(out, x, self.bias)


# Rows from which a bf16 product goes to oneDNN (F.linear) instead of our kernel, where our
# kernel has no AMX path. Its AVX-512 tile reads the weight once for every 16 outputs and is
# made for a decode step's few rows; oneDNN tiles many rows (AMX or AVX-512 BF16 on the CPUs
# that have them): on an Intel Xeon (Sapphire Rapids class, one thread, SmolLM2's 1536 x 576
# product) our AVX-512 tile takes 2.3 ms for 128 rows and 9.0 ms for 512, oneDNN 1.2 and
# 1.7 ms with the weight put back in nn.Linear's layout for the call (0.8 ms of it), and 0.5
# and 0.9 ms without; at 64 rows the two are even. On AMX our kernel (kernels/cpu/
# quant_linear.cpp: bf16_amx) keeps every row: as fast as oneDNN from 128 rows, 2.5 to 3
# times faster from 4 to 64, and no weight unpacked.
ONEDNN_ROWS = 128


class PackedBF16Linear(nn.Module):
    """A bf16 nn.Linear on our kernel, its weight reshuffled into the kernel's pairs (AMX's
    tile layout too); without AMX a prompt's many rows go to oneDNN, the weight unpacked for
    the call (one copy in memory: the packed one)."""

    def __init__(self, layer: nn.Linear, kernels):
        super().__init__()
        self.register_buffer("packed", pack_bf16(layer.weight.detach()))  # [out/16, in/2, 16, 2]
        self.bias, self.kernels = layer.bias, kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = _rows(x)  # [T, in]
        # a prompt's rows: oneDNN, unless our kernel runs them on AMX tiles on the path taken
        if rows.shape[0] >= ONEDNN_ROWS and self.kernels.bf16_amx_rows(rows.shape[1]) == 0:
            blocks, pairs = self.packed.shape[:2]
            weight = self.packed.permute(0, 2, 1, 3).reshape(blocks * 16, pairs * 2)
            return F.linear(x, weight, self.bias)  # [..., out]
        out = self.kernels.bf16_matmul(rows, self.packed)  # [T, out]
        return _finish(out, x, self.bias)


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


def triton_quantized_linears(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """Every QuantizedLinear as the Triton kernel's module (the Triton backend's
    ``process_weights``: any dtype)."""
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, QuantizedLinear):
                setattr(parent, name, TritonQuantizedLinear(child))
    return model


OWN_DTYPES = (torch.bfloat16, torch.float32)  # the activations our kernels take


def pack_linears_for_cpu(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Every product as the fastest CPU kernel for its weight, where one is faster than the
    twin (the module docstring says which runs where): ours where the extension built,
    torch's weight-only kernels for a bf16/fp16 model otherwise."""
    kernels = cpu_kernels() if dtype in OWN_DTYPES else None
    if kernels is None and dtype not in FAST_DTYPES:
        return model  # float32 without our kernels: torch's would be slower than the twin
    stack, head = decoder_stack(model), model.lm_head
    tied = isinstance(head, nn.Linear) and \
        head.weight.data_ptr() == stack.embed_tokens.weight.data_ptr()
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, QuantizedLinear):
                q = child.quantized
                own = {"int8": PackedInt8Linear, "int4": PackedInt4Linear,
                       "fp8": PackedFp8Linear}[q.scheme]
                if kernels and packable(*q.shape):
                    setattr(parent, name, own(child, kernels))
                elif dtype not in FAST_DTYPES or q.scheme == "fp8":
                    pass  # float32: the twin (torch's kernels are slower on float32); fp8:
                    # torch has no weight-only e4m3 kernel on the CPU
                elif q.scheme == "int8":
                    setattr(parent, name, Int8PackedLinear(child, dtype))
                elif packable(*q.shape):  # torch's int4 packing takes 16 outputs at a time
                    setattr(parent, name, Int4PackedLinear(child, dtype))
                # else: the twin, which takes any shape
            elif isinstance(child, nn.Linear) and kernels and dtype == torch.bfloat16 \
                    and packable(*child.weight.shape):
                setattr(parent, name, PackedBF16Linear(child, kernels))
    if tied and isinstance(model.lm_head, PackedBF16Linear):
        stack.embed_tokens = PackedEmbedding(model.lm_head)
    return model
