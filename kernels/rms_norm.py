"""rms_norm: RMSNorm with the residual add fused in, one program per token.

Every decoder layer runs ``residual = x + residual; y = weight * x / rms(x)`` twice. Done as
separate torch ops, the hidden state makes several trips through memory: the add reads two
tensors and writes one, the norm reads that sum again (and materialises float32 copies of it
on the way). This kernel loads a token's row of x and of the residual once, keeps it in
registers for the add, the mean of squares and the scaling, and writes the two results once:
the normalised row and the new residual (vLLM's ``fused_add_rms_norm``).

The order of operations is the twin's (``pagedllm.reference.ops.rms_norm``, Hugging Face's):
the add is rounded to the model's dtype *before* the statistics are taken, the mean of squares
is accumulated in float32, and the normalised row is rounded to the model dtype before the
weight multiplies it. Keeping those roundings is what makes bf16/fp16 outputs match the twin
bit for bit in most elements, rather than merely closely.
"""

import torch
import triton
import triton.language as tl

from pagedllm.reference.ops import rms_norm as rms_norm_reference

from .runtime import kernel_runner


# --8<-- [start:kernel]
@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr,          # [T, hidden] rows (residual: only with HAS_RESIDUAL)
    weight_ptr,                   # [hidden]
    out_ptr, new_residual_ptr,    # [T, hidden] contiguous outputs
    stride_x, stride_r,           # row strides of x and residual
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)  # [BLOCK], BLOCK = next power of two >= hidden
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # Round the sum to the model dtype, as the twin's `x + residual` does: the
        # statistics below (and the next layer) see exactly the residual that is stored.
        x = (x + r.to(tl.float32)).to(new_residual_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * hidden + cols, x, mask=mask)
        x = x.to(tl.float32)
    # Masked lanes hold 0, so they add nothing to the sum; divide by the true width.
    mean_square = tl.sum(x * x, axis=0) / hidden
    normed = x * tl.rsqrt(mean_square + eps)  # [BLOCK] float32
    normed = normed.to(x_ptr.dtype.element_ty).to(tl.float32)  # the twin's .to(x.dtype)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, (w * normed).to(out_ptr.dtype.element_ty),
             mask=mask)
# --8<-- [end:kernel]


# --8<-- [start:launcher]
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of ``pagedllm.reference.ops.rms_norm``: same arguments, same results.

    x [T, hidden] (and residual [T, hidden]) -> (normed, new residual), new tensors; x and
    residual are not modified. Without a residual the new residual is x itself, as in the
    twin. Output dtypes follow the twin's type promotion (e.g. fp32 weight on bf16 x gives a
    fp32 ``normed``).
    """
    tensors = (x, weight) if residual is None else (x, weight, residual)
    runner = kernel_runner(_rms_norm_kernel, *tensors)
    if runner is None:
        return rms_norm_reference(x, weight, eps, residual)
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden) if x.stride(-1) == 1 else x.contiguous().reshape(-1, hidden)
    if residual is not None:
        new_residual_dtype = torch.result_type(x, residual)
        # The twin's `x + residual` broadcasts and promotes; the kernel needs equal shapes and
        # rows that share a dtype with the stored sum.
        if residual.shape != x.shape or x.dtype != new_residual_dtype:
            raise ValueError("rms_norm's kernel needs x and residual of one shape and dtype")
        r2 = residual.reshape(-1, hidden) if residual.stride(-1) == 1 else \
            residual.contiguous().reshape(-1, hidden)
        new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # [T, hidden]
    else:
        r2, new_residual = x2, x  # no sum to store: the new residual is x itself
    out_dtype = torch.result_type(weight, x)  # `weight * normed.to(x.dtype)` in the twin
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)  # [T, hidden]
    num_rows = x2.shape[0]
    if num_rows == 0:
        return out, new_residual
    # A whole row lives in registers: fine up to 64 KB a row (hidden 16384 in fp32, as in
    # Triton's layer-norm tutorial); wider rows would need a loop over column tiles.
    block = triton.next_power_of_2(hidden)
    if block * x.element_size() > 65536:
        raise ValueError(f"rms_norm's kernel holds a row in registers: hidden {hidden} is too big")
    runner[(num_rows,)](
        x2, r2, weight.contiguous(), out, new_residual,
        x2.stride(0), r2.stride(0), hidden, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=min(max(block // 256, 1), 8),  # more threads for wider rows, as the tutorial
    )
    return out, new_residual
# --8<-- [end:launcher]
