"""rotary: rotate the step's queries and keys by their positions (RoPE), in place.

In the "rotate half" layout of Hugging Face's Llama, feature i of a head pairs with feature
i + head_dim/2, and the pair turns through the angle position * inv_freq[i]:

    out[i]          = x[i] * cos - x[i + d/2] * sin
    out[i + d/2]    = x[i + d/2] * cos + x[i] * sin

The torch twin (``pagedllm.reference.ops.rotary``) builds [T, head_dim] cos and sin tables,
splits and concatenates halves and allocates new q and k: several passes over memory. Here a
program loads a tile of heads of one token, computes cos/sin of that token's angles in
registers (they are shared by all the heads of the token: computed once per program), and
writes the rotated values back where they came from: q and k are each read once and written
once, and nothing is allocated. Rope scalings (Llama 3, linear) live entirely in ``inv_freq``,
which the model computes; the kernel only rotates.

head_dim need not be a power of two (80, 96): each half is padded to the next power of two and
the padding lanes are masked off.
"""

import torch
import triton
import triton.language as tl

from pagedllm.reference.ops import rotary as rotary_reference

from .runtime import kernel_runner


# --8<-- [start:kernel]
@triton.jit
def _rotary_kernel(
    # [T, heads, head_dim], [T, kv_heads, head_dim]; last dim stride 1
    q_ptr, k_ptr,
    positions_ptr,                # [T] integer positions
    inv_freq_ptr,                 # [head_dim / 2] float32
    stride_qt, stride_qh, stride_kt, stride_kh,
    num_heads, num_kv_heads, half,  # half = head_dim / 2
    q_tiles,                      # tiles of BLOCK_H heads that cover q; the rest, k
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    # One launch rotates q and k: the first q_tiles programs of a token take q's heads,
    # the others k's. Only scalars differ between the two cases; the code below is
    # shared.
    if tile < q_tiles:
        row, stride_h, heads_here, first_head = \
            q_ptr + token * stride_qt, stride_qh, num_heads, tile * BLOCK_H
    else:
        row, stride_h, heads_here, first_head = \
            k_ptr + token * stride_kt, stride_kh, num_kv_heads, \
            (tile - q_tiles) * BLOCK_H

    # [BLOCK_HALF]; BLOCK_HALF >= half (40, 48 pad to 64)
    dims = tl.arange(0, BLOCK_HALF)
    # float32 angles, as in the twin: position.float() * inv_freq. Large positions need
    # the float32 product and float32 cos/sin; only the final values are rounded to q's
    # dtype.
    position = tl.load(positions_ptr + token).to(tl.float32)
    # [BLOCK_HALF]
    angle = position * tl.load(inv_freq_ptr + dims, mask=dims < half, other=0.0)
    cos = tl.cos(angle)[None, :]  # [1, BLOCK_HALF], shared by every head of the tile
    sin = tl.sin(angle)[None, :]

    heads = first_head + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    # [BLOCK_H, BLOCK_HALF]
    mask = (heads[:, None] < heads_here) & (dims[None, :] < half)
    first = row + heads[:, None] * stride_h + dims[None, :]  # features [0, d/2)
    second = first + half  # features [d/2, d)
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(second, mask=mask, other=0.0)
    out_ty = x1.dtype
    # float32 math, one rounding at the end
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(out_ty), mask=mask)
    tl.store(second, (x2 * cos + x1 * sin).to(out_ty), mask=mask)
# --8<-- [end:kernel]


# --8<-- [start:launcher]
def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
           inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of ``pagedllm.reference.ops.rotary``: same arguments, same values.

    One difference: q [T, heads, head_dim] and k [T, kv_heads, head_dim] are rotated *in
    place*, and the returned pair is (q, k) themselves (the twin returns new tensors and
    leaves its inputs alone). Callers that use the return value, as the model does, cannot
    tell. Computed in float32 and rounded once, so bf16/fp16 results may differ from the
    twin's (which rounds cos/sin and each product) by a few ulps.
    """
    runner = kernel_runner(_rotary_kernel, q, k, positions)
    if runner is None:
        return rotary_reference(q, k, positions, inv_freq)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("rotary's kernel works in place: q and k need a contiguous last dim")
    if q.dtype != k.dtype or head_dim % 2 or k.shape[2] != head_dim:
        raise ValueError("rotary's kernel needs q and k of one dtype and one even head_dim")
    if num_tokens == 0:
        return q, k
    # As in the twin, inv_freq may live elsewhere (the model keeps it in float32).
    inv_freq = inv_freq.to(device=q.device, dtype=torch.float32).contiguous()  # [hd / 2]
    half = head_dim // 2
    if inv_freq.numel() != half:
        raise ValueError(f"inv_freq has {inv_freq.numel()} frequencies, head_dim {head_dim}")
    block_half = triton.next_power_of_2(half)
    # About 1024 elements per half-tile: all heads of a token in one or two programs.
    block_h = min(triton.next_power_of_2(max(num_heads, num_kv_heads)),
                  max(1, 1024 // block_half))
    q_tiles = triton.cdiv(num_heads, block_h)
    grid = (num_tokens, q_tiles + triton.cdiv(num_kv_heads, block_h))
    runner[grid](
        q, k, positions, inv_freq,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        num_heads, num_kv_heads, half, q_tiles,
        BLOCK_H=block_h, BLOCK_HALF=block_half,
    )
    return q, k
# --8<-- [end:launcher]
