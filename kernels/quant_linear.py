"""quant_linear: a weight-only quantized matrix product, the weight dequantized in registers.

y [M, N] = x [M, K] @ W^T with W stored as the twin stores it (``reference/ops/weight_quant.py``):
int8 codes [N, K] with a scale per output row (W8A16), e4m3 numbers [N, K] with a scale per
output row (fp8, W8A16), or int4 codes two a byte [N, K / 2] with a scale and zero point per
group of inputs (W4A16). A decode step's product reads every weight
once for a few rows of x, so its time is the weight's bytes: reading 1 or 0.5 byte a weight
instead of 2 is the whole point, and the weight must never be expanded in memory. Each program
computes a [BLOCK_M, BLOCK_N] tile of y, walking K in tiles of BLOCK_K: it loads the codes of
its [BLOCK_N, BLOCK_K] weight tile, turns them into x's dtype in registers and feeds
``tl.dot`` (float32 accumulation).

int4 needs no interleaving of nibbles: byte j of a row holds inputs 2j (low nibble) and 2j + 1
(high nibble), so the program loads the even and the odd columns of x separately and makes two
products, one per nibble. A K tile never straddles two groups (BLOCK_K divides the group size),
so each tile reads one scale and one zero point per output row. int8's scale is per row: it
multiplies the finished sum once; so does fp8's.

fp8 reaches the kernel as bytes (the launcher views the e4m3 weight as uint8) and each byte is
widened by bit arithmetic, as paged attention widens an fp8 KV cache (``_fp8_to_f32``): the e4m3
number moved to the top of an fp16 one, then multiplied by 2 ** 8 for the exponents' different
biases. The conversion is exact, and needs no fp8 support from the GPU: Triton gives an A100
(sm_80) no e4m3 type at all, and it runs this path like an H100. An e4m3 value has 3 mantissa
bits, so it is exact in bf16 and fp16 too, the dtypes ``tl.dot`` takes.

The twin dequantizes in float32; here the dequantized tile is rounded to x's dtype before the
product (what ``tl.dot`` takes), so results agree to a rounding of the weight in that dtype.
"""

import torch
import triton
import triton.language as tl

from pagedllm.reference.ops.weight_quant import QuantizedWeight, quantized_linear

from .paged_attention import _fp8_to_f32
from .runtime import interpreting, kernel_runner


# --8<-- [start:kernel]
@triton.jit
def _quant_linear_kernel(
    x_ptr,            # [M, K], contiguous
    w_ptr,            # int8 [N, K], uint8 [N, K] (fp8's bytes) or uint8 [N, K / 2], contiguous
    scale_ptr,        # [N] (int8, fp8) or [N, K / GROUP] (int4), x's dtype
    zero_ptr,         # [N, K / GROUP] (int4; unused for int8)
    bias_ptr,         # [N] or unused
    out_ptr,          # [M, N], contiguous
    M, N, K,
    INT4: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, FP8: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,  # the interpreter with bf16: its tl.dot cannot multiply bf16
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]: output features
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if INT4:
        half = tl.arange(0, BLOCK_K // 2)  # [BK/2]: byte j holds inputs 2j and 2j + 1
        for k0 in range(0, K, BLOCK_K):
            kb = k0 // 2 + half  # [BK/2] byte columns
            ok = kb < K // 2
            # The tile loaded transposed, [BK/2, BN]: the product's own orientation.
            packed = tl.load(w_ptr + cols[None, :] * (K // 2) + kb[:, None],
                             mask=ok[:, None] & col_ok[None, :], other=0)  # [BK/2, BN]
            g = k0 // GROUP
            s = tl.load(scale_ptr + cols * (K // GROUP) + g, mask=col_ok, other=0.0)
            z = tl.load(zero_ptr + cols * (K // GROUP) + g, mask=col_ok, other=0.0)
            s, z = s.to(tl.float32)[None, :], z.to(tl.float32)[None, :]  # [1, BN]
            lo = ((packed & 0xF).to(tl.float32) - 8.0) * s + z  # inputs 2j, [BK/2, BN]
            hi = ((packed >> 4).to(tl.float32) - 8.0) * s + z  # inputs 2j + 1
            x_even = tl.load(x_ptr + rows[:, None] * K + 2 * kb[None, :],
                             mask=row_ok[:, None] & ok[None, :], other=0.0)  # [BM, BK/2]
            x_odd = tl.load(x_ptr + rows[:, None] * K + 2 * kb[None, :] + 1,
                            mask=row_ok[:, None] & ok[None, :], other=0.0)
            if DOT_F32:
                x_even, x_odd = x_even.to(tl.float32), x_odd.to(tl.float32)
            acc += tl.dot(x_even, lo.to(x_even.dtype))  # [BM, BN]
            acc += tl.dot(x_odd, hi.to(x_odd.dtype))
    else:
        ks = tl.arange(0, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + ks  # [BK]
            ok = k < K
            q = tl.load(w_ptr + cols[None, :] * K + k[:, None],
                        mask=ok[:, None] & col_ok[None, :], other=0)  # [BK, BN] int8 or bytes
            xt = tl.load(x_ptr + rows[:, None] * K + k[None, :],
                         mask=row_ok[:, None] & ok[None, :], other=0.0)  # [BM, BK]
            if DOT_F32:
                xt = xt.to(tl.float32)
            if FP8:
                w = _fp8_to_f32(q, False)  # e4m3 bytes -> their values, exactly
            else:
                w = q.to(tl.float32)
            acc += tl.dot(xt, w.to(xt.dtype))  # codes are exact in bf16/fp16
        s = tl.load(scale_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)  # [BN]
        acc = acc * s[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])
# --8<-- [end:kernel]


# --8<-- [start:launcher]
def quant_linear(x: torch.Tensor, qw: QuantizedWeight,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """Triton version of ``pagedllm.reference.ops.weight_quant.quantized_linear``: x [M, K]
    (bf16/fp16/fp32) -> [M, N] in x's dtype. Falls back to the twin off CUDA (without the
    interpreter)."""
    tensors = (x, qw.qweight, qw.scales) + ((qw.zeros,) if qw.zeros is not None else ())
    runner = kernel_runner(_quant_linear_kernel, *tensors)
    if runner is None:
        return quantized_linear(x, qw, bias)
    N, K = qw.shape
    if x.shape[-1] != K:
        raise ValueError(f"quant_linear: x has {x.shape[-1]} inputs, the weight {K}")
    x2 = x.reshape(-1, K).contiguous()  # [M, K]
    M = x2.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out.reshape(*x.shape[:-1], N)
    int4, fp8 = qw.scheme == "int4", qw.scheme == "fp8"
    # fp8 as its bytes: no launch has an fp8 pointer type (sm_80 has none)
    qweight = qw.qweight.view(torch.uint8) if fp8 else qw.qweight
    block_k = min(qw.group_size, 64) if int4 else 64  # divides the group: one scale a tile
    block_m = 16 if M <= 16 else 32  # tl.dot's smallest tile is 16
    block_n = 64
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    zeros = qw.zeros if int4 else qw.scales  # unused for int8; any tensor of the right device
    runner[grid](x2, qweight, qw.scales, zeros, bias if bias is not None else out, out,
                 M, N, K, INT4=int4, GROUP=qw.group_size or 1, HAS_BIAS=bias is not None,
                 FP8=fp8,
                 BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                 DOT_F32=x.dtype == torch.bfloat16 and interpreting())
    return out.reshape(*x.shape[:-1], N)
# --8<-- [end:launcher]
