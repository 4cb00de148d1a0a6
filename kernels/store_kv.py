"""store_kv: write one step's new K and V rows into the paged cache, each at its slot.

After the QKV projection and rotary, every token of the step has a K row and a V row of shape
[kv_heads, head_dim]. The block table has already given each token a *slot*: its row in the
flat cache view [num_blocks * block_size, kv_heads, head_dim], with -1 for padding rows whose
K/V must not be kept. This kernel is a scatter: one program per token (and per tile of heads)
reads the token's slot, then copies its K and V rows there.

Why a kernel for a copy? The torch twin (``pagedllm.reference.ops.store_kv``) first filters out
the -1 rows (a boolean mask, a host sync on ``.all()``, and gathered copies of k, v and the
slots) and then runs two indexed assignments. Here each K/V element is read once and written
once, padding rows cost one load of their slot, and K and V move in the same launch. The rows
may be strided views (K sliced out of a fused QKV output) since every stride is passed in.

Quantizing on the way in
------------------------
With a quantized ``kv_cache_dtype`` (``reference/ops/kv_quant.py``) the row is quantized in
registers between the load and the store, and the kernel must store the very bytes the twin
stores: attention reads what was written, and a test compares bytes, not values. So nothing is
left to the compiler's or the interpreter's choice of rounding:

- fp8 (e4m3, e5m2): x / scale by IEEE division (``tl.math.div_rn``; Triton's ``/`` on fp32 is an
  approximate division on a GPU), clamped to the format's largest value, then rounded to fp8 by
  integer arithmetic on the float's bits, the same steps as torch's conversion (nearest, ties to
  even). The cache is written as raw bytes (uint8): a GPU without fp8 conversions (an A100 has
  none for e4m3) runs the same code, and Triton's interpreter, whose own float-to-fp8
  conversion drops the carry of a rounding into the exponent (7.94 becomes 4, not 8), is never
  asked.
- int8 (symmetric): the row's largest |x| (one token, one KV head), divided by 127 and rounded
  to bfloat16 by the same bit arithmetic (the interpreter truncates a float-to-bf16 cast), is
  the row's scale, written at [slot, head] of the scale tensor; then floor(x / scale + 0.5)
  clamped to +-127.
- int4 (asymmetric): the row's range gives scale = bf16((max - min) / 15) (1 for a row of
  equal values) and zero = bf16(min), written as the pair [slot, head, 0:2] of the scale
  tensor; then floor((x - zero) / scale + 0.5) clamped to 0..15 (the subtraction in fp32 with
  the stored, rounded zero: a zero rounded above the minimum clamps to 0, a scale rounded down
  clamps at 15). The row is loaded as two halves, and element d and d + head_dim / 2 are packed
  into byte d: the first in the low nibble, the second in the high one.

Subnormal inputs come out as the twin's too: IEEE division and fp32 addition keep subnormals on
a GPU (``div.rn.f32``, ``add.f32``); the one libdevice call, floor, flushes them, but its input
x / scale + 0.5 is either 0 or at least 2 ** -26 in size.
"""

import torch
import triton
import triton.language as tl

from pagedllm.reference.ops import kv_cache_format
from pagedllm.reference.ops import store_kv as store_kv_reference

from .runtime import kernel_runner


# --8<-- [start:bits]
@triton.jit
def _to_f32(x):
    """Any float tile to fp32, exactly: bf16 by its bits (the upper half of an fp32's), which no
    conversion routine of the interpreter or the GPU can get wrong, subnormals included."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def _fp8_bits(y, E5M2: tl.constexpr):
    """fp32 y, within the format's range, to the fp8 byte torch's conversion gives (nearest,
    ties to even), as int32 values 0..255."""
    MANT: tl.constexpr = 2 if E5M2 else 3  # mantissa bits
    BIAS: tl.constexpr = 15 if E5M2 else 7  # exponent bias
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80  # fp32's sign bit, moved to where fp8 keeps it
    a = bits & 0x7FFFFFFF  # |y|'s bits
    # A normal number keeps its top MANT mantissa bits: re-bias the exponent, add just under half
    # of the dropped part, plus the lowest kept bit (so that a tie rounds to the even
    # neighbour), and shift; a carry out of the mantissa correctly bumps the exponent.
    odd = (a >> (23 - MANT)) & 1
    normal = (a + ((BIAS - 127) << 23) + ((1 << (22 - MANT)) - 1) + odd) >> (23 - MANT)
    # Below the smallest normal, 2 ** (1 - BIAS), fp8's step is fixed, 2 ** (1 - BIAS - MANT):
    # adding 2 ** (24 - BIAS - MANT), whose fp32 ulp is that step, makes the fp32 adder round |y|
    # to a multiple of the step (to nearest even), and the sum's low bits count the steps.
    DENORM: tl.constexpr = (151 - BIAS - MANT) << 23  # the bits of 2 ** (24 - BIAS - MANT)
    denorm = tl.full(y.shape, DENORM, tl.int32)
    small = ((a.to(tl.float32, bitcast=True) + denorm.to(tl.float32, bitcast=True))
             .to(tl.int32, bitcast=True) - DENORM)
    byte = tl.where(a < ((128 - BIAS) << 23), small, normal)
    byte = tl.where(a > 0x7F800000, 0x7F, byte)  # NaN stays NaN (0x7F in both formats)
    return byte | sign


@triton.jit
def _bf16_bits(x):
    """fp32 x >= 0 to the bits of the nearest bfloat16 (ties to even), as int32."""
    bits = x.to(tl.int32, bitcast=True)
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16


@triton.jit
def _bf16_bits_signed(x):
    """Any fp32 x to the bits of the nearest bfloat16 (ties to even), as int32 0..0xFFFF: the
    magnitude rounded as above, the sign bit put back."""
    bits = x.to(tl.int32, bitcast=True)
    mag = (bits & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    return _bf16_bits(mag) | ((bits >> 16) & 0x8000)
# --8<-- [end:bits]


# --8<-- [start:quantize]
@triton.jit
def _row_scale(amax, QMAX: tl.constexpr):
    """Rows' scales from their largest |value| (int8) or their range max - min (int4)
    [BLOCK_H]: bf16(amax / QMAX), 1 where that is 0, as (bf16 bits as int32, fp32 values)."""
    bits = _bf16_bits(tl.math.div_rn(amax, QMAX))
    bits = tl.where(bits == 0, 0x3F80, bits)  # a row of zeros: scale 1 (0x3F80 is bf16 1.0)
    return bits, (bits << 16).to(tl.float32, bitcast=True)


@triton.jit
def _bits_to_f32(bits):
    """bf16 bits (int32 0..0xFFFF) to the fp32 value."""
    return (bits << 16).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_asym(x, scale, zero, QMAX: tl.constexpr):
    """x [BLOCK_H, BLOCK_D] fp32 with its rows' scales and zeros [BLOCK_H]:
    floor((x - zero) / scale + 0.5), clamped to 0..QMAX, as int32."""
    q = tl.floor(tl.math.div_rn(x - zero[:, None], scale[:, None]) + 0.5)
    return tl.clamp(q, 0.0, QMAX).to(tl.int32)


@triton.jit
def _quantize(x, scale, QMAX: tl.constexpr):
    """x [BLOCK_H, BLOCK_D] fp32 over its rows' scales [BLOCK_H]: floor(x / s + 0.5), clamped."""
    q = tl.floor(tl.math.div_rn(x, scale[:, None]) + 0.5)
    return tl.clamp(q, -QMAX, QMAX)


@triton.jit
def _store_rows(src_ptr, stride_t, stride_h, cache_ptr, scale_ptr, token, slot, heads, dims,
                kv_heads, head_dim, KV_FORMAT: tl.constexpr, QMAX: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One of K or V: the token's rows [BLOCK_H heads, head_dim] into its slot (-1: nowhere),
    as the format stores them."""
    # The slot is broadcast to the tile before any comparison: Triton 3.9's interpreter
    # mis-types a scalar comparison and-ed with a block mask.
    slots = slot + tl.zeros([BLOCK_H], dtype=tl.int64)  # [BH]
    row_ok = (slots >= 0) & (heads < kv_heads)  # [BH]: a padding row turns every lane off
    row = slots * kv_heads + heads  # [BH]: the (slot, head) row of the flat cache, int64
    src = src_ptr + token * stride_t + heads[:, None] * stride_h + dims[None, :]  # [BH, BD]
    if KV_FORMAT == "int4":
        half = head_dim // 2
        mask = row_ok[:, None] & (dims[None, :] < half)  # [BH, BD]
        lo = _to_f32(tl.load(src, mask=mask, other=0.0))  # [BH, BD]: elements 0 .. half - 1
        hi = _to_f32(tl.load(src + half, mask=mask, other=0.0))  # elements half .. head_dim - 1
        # The row's range over its real lanes (padding lanes of BLOCK_D read as +-inf here)
        x_min = tl.minimum(tl.min(tl.where(mask, lo, float("inf")), axis=1),
                           tl.min(tl.where(mask, hi, float("inf")), axis=1))  # [BH]
        x_max = tl.maximum(tl.max(tl.where(mask, lo, float("-inf")), axis=1),
                           tl.max(tl.where(mask, hi, float("-inf")), axis=1))
        x_min = tl.where(row_ok, x_min, 0.0)  # a row not stored: anything finite
        x_max = tl.where(row_ok, x_max, 0.0)
        bits, scale = _row_scale(x_max - x_min, QMAX)  # bf16((max - min) / 15), 0 -> 1
        zero_bits = _bf16_bits_signed(x_min)
        zero = _bits_to_f32(zero_bits)
        lo = _quantize_asym(lo, scale, zero, QMAX)  # nibbles 0..15
        hi = _quantize_asym(hi, scale, zero, QMAX)
        tl.store(cache_ptr + row[:, None] * half + dims[None, :], (lo | (hi << 4)).to(tl.uint8),
                 mask=mask)
        # the pair (scale, zero) at [slot, head, 0:2]
        tl.store(scale_ptr + row * 2, bits.to(tl.uint16).to(tl.bfloat16, bitcast=True),
                 mask=row_ok)
        tl.store(scale_ptr + row * 2 + 1, zero_bits.to(tl.uint16).to(tl.bfloat16, bitcast=True),
                 mask=row_ok)
    else:
        mask = row_ok[:, None] & (dims[None, :] < head_dim)  # [BH, BD]
        dst = cache_ptr + row[:, None] * head_dim + dims[None, :]  # [BH, BD]
        if KV_FORMAT == "auto":  # a copy: the bits of any dtype (fp32, bf16, fp16) unchanged
            tl.store(dst, tl.load(src, mask=mask), mask=mask)
        else:
            x = _to_f32(tl.load(src, mask=mask, other=0.0))  # [BH, BD]
            if KV_FORMAT == "int8":
                bits, scale = _row_scale(tl.max(tl.abs(x), axis=1), QMAX)
                tl.store(dst, _quantize(x, scale, QMAX).to(tl.int8), mask=mask)
            else:  # fp8: one scale for the whole layer
                y = tl.math.div_rn(x, tl.load(scale_ptr))
                y = tl.clamp(y, -QMAX, QMAX, propagate_nan=tl.PropagateNan.ALL)
                tl.store(dst, _fp8_bits(y, KV_FORMAT == "fp8_e5m2").to(tl.uint8), mask=mask)
    if KV_FORMAT == "int8":  # the row's scale at [slot, head]
        tl.store(scale_ptr + row, bits.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=row_ok)
# --8<-- [end:quantize]


# --8<-- [start:kernel]
@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr,                    # [T, kv_heads, head_dim] each, any strides, last dim 1
    k_cache_ptr, v_cache_ptr,        # [num_blocks * block_size, kv_heads, stored] contiguous
    k_scale_ptr, v_scale_ptr,        # fp8: [1] fp32; int8: [num_blocks * block_size, kv_heads]
                                     # bf16, contiguous; int4: [..., kv_heads, 2] (scale,
                                     # zero); auto: unused
    slot_ptr,                        # [T] int32/int64, -1 = skip
    stride_kt, stride_kh, stride_vt, stride_vh,
    kv_heads, head_dim,
    KV_FORMAT: tl.constexpr,         # auto | fp8_e4m3 | fp8_e5m2 | int8 | int4
    QMAX: tl.constexpr,              # the format's largest stored magnitude, int4's top level
                                     # (15); auto: unused
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head_tile = tl.program_id(1)
    # int64: slot * row size overflows int32 once the cache holds more than 2**31 elements.
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    # [BLOCK_D] >= head_dim (80, 96 are masked up to 128); int4: >= head_dim / 2, a half row
    dims = tl.arange(0, BLOCK_D)
    _store_rows(k_ptr, stride_kt, stride_kh, k_cache_ptr, k_scale_ptr, token, slot, heads, dims,
                kv_heads, head_dim, KV_FORMAT, QMAX, BLOCK_H, BLOCK_D)
    _store_rows(v_ptr, stride_vt, stride_vh, v_cache_ptr, v_scale_ptr, token, slot, heads, dims,
                kv_heads, head_dim, KV_FORMAT, QMAX, BLOCK_H, BLOCK_D)
# --8<-- [end:kernel]


# --8<-- [start:launcher]
def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, kv_cache_dtype: str = "auto",
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Triton version of ``pagedllm.reference.ops.store_kv``, same arguments, same effect.

    k, v [T, kv_heads, head_dim] (last dim contiguous; other strides free); k_cache, v_cache
    [num_blocks, block_size, kv_heads, stored head_dim] in the format's dtype, contiguous;
    slot_mapping [T], -1 = skip. fp8: k_scale, v_scale [1] float32; int8: the per-token-head
    scales [num_blocks, block_size, kv_heads] bfloat16, contiguous, written; int4: the
    per-token-head (scale, zero) pairs [num_blocks, block_size, kv_heads, 2], the same.
    Slots must lie inside the cache: unlike the twin's indexing, the kernel does not check.
    """
    fmt = kv_cache_format(kv_cache_dtype)
    scales = [s for s in (k_scale, v_scale) if s is not None]
    runner = kernel_runner(_store_kv_kernel, k, v, k_cache, v_cache, slot_mapping, *scales)
    if runner is None:
        return store_kv_reference(k, v, k_cache, v_cache, slot_mapping, kv_cache_dtype,
                                  k_scale, v_scale)
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return None
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("store_kv's kernel needs contiguous caches")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("store_kv's kernel needs k and v with a contiguous last dimension")
    stored = k_cache.shape[-1]
    if fmt.name != "auto":
        if fmt.values_per_byte > 1 and head_dim % 2:
            raise ValueError(f"int4 packs two values per byte: head_dim {head_dim} is odd")
        if k_cache.dtype != fmt.storage_dtype or stored != fmt.storage_head_dim(head_dim):
            raise ValueError(f"a {fmt.name} cache holds {fmt.storage_dtype} rows of "
                             f"{fmt.storage_head_dim(head_dim)}, got {k_cache.dtype} rows of "
                             f"{stored}")
        if k_scale is None or v_scale is None:
            raise ValueError(f"kv_cache_dtype {fmt.name!r} needs k_scale and v_scale")
        pair = (2,) if fmt.zero_point else ()  # int4: (scale, zero)
        if fmt.scales == "per_token_head" and not (
                k_scale.is_contiguous() and v_scale.is_contiguous()
                and k_scale.shape == v_scale.shape == (*k_cache.shape[:3], *pair)):
            raise ValueError("per-token-head scales must be contiguous [num_blocks, block_size, "
                             f"kv_heads{', 2' if pair else ''}] tensors")
    if fmt.scales == "per_tensor":  # the bytes of the fp8 values: see the module's docstring
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    if fmt.scales == "none":
        k_scale, v_scale = k_cache, v_cache  # unused pointers
    block_d = triton.next_power_of_2(fmt.storage_head_dim(head_dim))
    # About 2048 elements per program: all heads of a token in one program for typical GQA
    # shapes (8 x 128), more tiles only for wide MHA caches.
    block_h = min(triton.next_power_of_2(kv_heads), max(1, 2048 // block_d))
    grid = (num_tokens, triton.cdiv(kv_heads, block_h))
    runner[grid](
        k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_heads, head_dim,
        KV_FORMAT=fmt.name, QMAX=fmt.qmax,
        BLOCK_H=block_h, BLOCK_D=block_d,
    )
    return None
# --8<-- [end:launcher]
