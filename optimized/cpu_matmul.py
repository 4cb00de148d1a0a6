"""Few-row products on a CPU with AVX-512 BF16: int4 groups and bf16 weights, our own kernel.

torch's weight-only CPU kernels read int4 codes at about 1.2 GB/s at 16 rows on this project's
CPU (AMD EPYC, AVX-512 BF16, no AMX), slower than bf16 ``F.linear`` on twice the bytes, and
oneDNN's bf16 product of one row reads about 6 GB/s of a 24 GB/s memory. ``csrc/cpu_matmul.cpp``
turns the codes into bf16 inside the registers and multiplies with ``vdpbf16ps``; its comment
has the arithmetic. Built on first use with torch's extension builder (a C++ compiler and
ninja; about 30 s, then cached), and used only where the CPU has AVX-512 BF16: elsewhere, or
where the build fails, ``cpu_kernels()`` says why and the layers keep torch's kernels.

The packed layouts: for each block of 16 outputs, the inputs in pairs, so that one 512-bit
register holds 16 outputs x 2 inputs (32 bf16), the operand of one ``vdpbf16ps``.
- bf16: ``[N / 16, K / 2, 16, 2]`` (a reshuffle of ``W [N, K]``, the same bytes).
- int4: ``[N / 16, K / 4, 32]`` bytes: byte ``2n + j`` of a 32-byte run holds the codes of
  output n, inputs ``4i + j`` (low nibble) and ``4i + 2 + j`` (high nibble); scales and
  ``zero - 136 scale`` as float32 ``[N / 16, K / group, 16]``.
"""

import functools
import logging
import os

import torch

from pagedllm.reference.ops import rms_norm as rms_norm_reference
from pagedllm.reference.ops.weight_quant import QuantizedWeight

log = logging.getLogger(__name__)
SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "cpu_matmul.cpp")


@functools.cache
def cpu_kernels():
    """The kernels' operators (``torch.ops.pagedllm_cpu``: ``int4_matmul``, ``bf16_matmul``),
    or None where this CPU or machine cannot run them (logged once)."""
    try:
        from torch.utils.cpp_extension import load
        ext = load("pagedllm_cpu_matmul", [SOURCE], extra_cflags=["-O3"], verbose=False)
    except Exception as e:  # no compiler, no ninja, a failed build: torch's kernels instead
        log.warning("pagedllm: the CPU matmul kernel did not build (%s: %s); using torch's "
                    "kernels", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None
    if not ext.supported():
        log.info("pagedllm: this CPU has no AVX-512 BF16; using torch's kernels")
        return None
    return torch.ops.pagedllm_cpu  # registered when the extension loaded


def packable(out_features: int, in_features: int) -> bool:
    return out_features % 16 == 0 and in_features % 4 == 0


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] bf16 -> [N / 16, K / 2, 16, 2]: per block of 16 outputs, the inputs in pairs."""
    n, k = weight.shape
    return weight.reshape(n // 16, 16, k // 2, 2).transpose(1, 2).contiguous()


def unpack_bf16_rows(packed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows of W [N, K] read from its packed form: an embedding tied to a packed LM head."""
    nb, k2, _, _ = packed.shape
    return packed[rows // 16, :, rows % 16, :].reshape(*rows.shape, k2 * 2)  # [..., K]


def pack_int4(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The twin's int4 codes, scales and zero points in the kernel's layout."""
    n, k = qw.shape
    codes = torch.stack([qw.qweight & 0xF, qw.qweight >> 4], dim=-1).view(n, k)  # [N, K]
    # [N/16, 16 outputs, K/4, 2 (low: inputs 4i, 4i+1 | high: 4i+2, 4i+3), 2 (j)]
    codes = codes.view(n // 16, 16, k // 4, 2, 2).permute(0, 2, 3, 1, 4)  # [nb, K/4, 2, 16, 2]
    low, high = codes[:, :, 0].reshape(n // 16, k // 4, 32), codes[:, :, 1].reshape(
        n // 16, k // 4, 32)
    packed = (low | (high << 4)).contiguous()  # [N/16, K/4, 32] uint8
    groups = k // qw.group_size

    def per_block(t):  # [N, G] -> [N/16, G, 16] float32
        return t.float().view(n // 16, 16, groups).transpose(1, 2).contiguous()

    scales = per_block(qw.scales)
    return packed, scales, (per_block(qw.zeros) - 136 * scales).contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin's ``rms_norm`` (same arguments, same roundings) in one pass a row, for bf16
    rows and weight; any other input goes to the twin."""
    kernels = cpu_kernels()
    if (kernels is None or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16
            or x.shape[-1] % 16 or (residual is not None and (
                residual.shape != x.shape or residual.dtype != x.dtype))):
        return rms_norm_reference(x, weight, eps, residual)
    if residual is None:
        return kernels.rms_norm(x.contiguous(), weight, eps), x  # the new residual is x
    return kernels.add_rms_norm(x.contiguous(), residual.contiguous(), weight, eps)
