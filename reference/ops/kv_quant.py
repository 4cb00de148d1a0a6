"""Quantizing the KV cache: what a quantized pool stores, and the definitions the kernels match.

A token's K (and V) for one KV head is head_dim numbers. Stored in the model's dtype they cost
2 bytes each (bf16/fp16 on a GPU, 4 in float32). Stored in fewer bits, more tokens fit in the
same memory, at the price of a rounding error in every key and value attention reads:

    kv_cache_dtype  stored as                       scale                          bytes/element
    auto            the model's dtype                none                           2 (4 in fp32)
    float16         fp16 (16-bit names: fp16, bf16)  none                           2
    fp8_e4m3        float8: 4 exponent, 3 mantissa   one per layer for K, one for V  1
    fp8_e5m2        float8: 5 exponent, 2 mantissa   one per layer for K, one for V  1
    int8            integer in [-127, 127]           one per token and KV head       1
    int4            integer in [0, 15], two per byte scale + zero per token and head 1/2

A 16-bit name (vLLM's ``bfloat16``; ``float16``, ``fp16``, ``bf16``) asks for a cache of that dtype:
the model's own (the same as ``auto``, which the engine's config makes it) or, beside a model of
another dtype, a cache that K and V are rounded to on the way in and widened back from as they
are read (a float32 model on the CPU with a bf16 cache: half the bytes, bf16's rounding).

A floating-point format keeps a relative error whatever the magnitude (e4m3: 3 mantissa bits,
half a step is 2**-4 = 6.25 % at worst; e5m2: 12.5 %), down to its smallest normal number, but
it has a largest one: 448 for e4m3, 57344 for e5m2. A per-tensor scale (vLLM's k_scale, v_scale)
divides every value before it is stored, so that the layer's largest value lands inside the
range. With the default scale of 1.0 a key of 600 is clipped to 448 (and vLLM only warns);
``calculate_kv_scales`` sets the scales from the first batch instead.

An integer format has a uniform step, so an error of at most half a step. One scale per token
and KV head (computed when the token is written, stored beside its block) keeps the groups small,
so one token's outlier cannot coarsen another token's step. Scales are bfloat16: float32's range
(a float16 scale underflows for groups of tiny values) in 2 bytes.

- int8 is symmetric: step = the row's largest |value| / 127, no zero point. A zero point would
  cost 2 more bytes per token and head (with head_dim 64, int8 would keep 1.88x the tokens of
  bf16 instead of 1.94x), and 255 levels leave the error small anyway. Attention applies the
  scale to a whole dot product: q · (s k) = s (q · k).
- int4 has only 16 levels, and symmetric int4 is too coarse: on SmolLM2-135M it raised the
  perplexity by 36 %. Two changes bring it to a few percent (benchmarks/kv_quant.py). It is
  asymmetric: x ≈ q · s + z with q in 0..15, s = (max - min) / 15 and z = min, so all 16 levels
  cover the row's actual range (attention adds one term: q · (s k + z) = s (q · k) + z Σ q). And
  the attention context rotates q, k and v by a Hadamard matrix H before they reach the cache
  (``hadamard`` below; model/attention.py): H is orthogonal, so (qH) · (kH) = q · k and the
  output is rotated back, but a rotated row spreads a few large channels (keys have them) over
  all channels, so that they no longer set the step of every other value of the token.

int4 packs two values per byte: byte j of a row holds element j in its low 4 bits and element
j + head_dim / 2 in its high 4 bits. Splitting the row into halves, not neighbours, lets a kernel
unpack a tile with two shifts and attend with two half-width matrix products.

Rounding is floor(y + 0.5) (half up), written out so that a kernel does exactly the same
(torch.round rounds half to even); division by the scale is IEEE division in both.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

SCALE_DTYPE = torch.bfloat16  # per-token-head scales
# vLLM's calculate_kv_scales: scale = largest |value| of the first batch / these, so that values
# up to 448 / 200 = 2.2x the calibration batch's largest key still fit e4m3.
K_SCALE_CONSTANT, V_SCALE_CONSTANT = 200.0, 100.0


# --8<-- [start:format]
@dataclass(frozen=True)
class KVCacheFormat:
    """How one kv_cache_dtype stores a [head_dim] row of K or V."""

    name: str  # auto | fp8_e4m3 | fp8_e5m2 | int8 | int4
    storage_dtype: torch.dtype | None  # None: the model's dtype
    scales: str  # "none" | "per_tensor" | "per_token_head"
    # the largest magnitude stored (448, 57344, 127; int4: the top level, 15)
    qmax: float
    values_per_byte: int = 1  # int4: 2
    zero_point: bool = False  # int4: a (scale, zero) pair per token and head
    # int4: the attention context stores and reads Hadamard-rotated rows
    rotated: bool = False

    def storage_head_dim(self, head_dim: int) -> int:
        """Elements of the storage dtype per [head_dim] row."""
        if self.values_per_byte > 1:
            return head_dim // self.values_per_byte
        return head_dim

    def dtype_of(self, model_dtype: torch.dtype) -> torch.dtype:
        return self.storage_dtype or model_dtype

    scale_dtype = SCALE_DTYPE  # of per-token-head scales

    def bytes_per_token_head(self, head_dim: int, model_dtype_bytes: int) -> int:
        """Bytes one token costs for one KV head and one of K or V, its scale
        included."""
        item = self.storage_dtype.itemsize if self.storage_dtype else model_dtype_bytes
        return (self.storage_head_dim(head_dim) * item
                + self.scale_numel * SCALE_DTYPE.itemsize)

    @property
    def scale_numel(self) -> int:
        """Scale values per token and head: 0, 1 (a scale) or 2 (a scale and a zero)."""
        if self.scales != "per_token_head":
            return 0
        return 2 if self.zero_point else 1
# --8<-- [end:format]


def _fp8(attr: str) -> torch.dtype | None:
    return getattr(torch, attr, None)  # None on a torch without float8 dtypes


KV_CACHE_FORMATS = {
    "auto": KVCacheFormat("auto", None, "none", 0.0),
    "fp8_e4m3": KVCacheFormat("fp8_e4m3", _fp8("float8_e4m3fn"), "per_tensor", 448.0),
    "fp8_e5m2": KVCacheFormat("fp8_e5m2", _fp8("float8_e5m2"), "per_tensor", 57344.0),
    "int8": KVCacheFormat("int8", torch.int8, "per_token_head", 127.0),
    "int4": KVCacheFormat("int4", torch.uint8, "per_token_head", 15.0, values_per_byte=2,
                          zero_point=True, rotated=True),
    # a 16-bit cache: no scales, the values rounded to the dtype (the model's own: "auto")
    "float16": KVCacheFormat("float16", torch.float16, "none", 65504.0),
    "bfloat16": KVCacheFormat("bfloat16", torch.bfloat16, "none", 0.0),
}
# vLLM's names, and the 16-bit dtypes' short ones
KV_CACHE_ALIASES = {"fp8": "fp8_e4m3", "fp16": "float16", "bf16": "bfloat16"}
KV_CACHE_DTYPES = (*KV_CACHE_FORMATS, *KV_CACHE_ALIASES)


def kv_cache_format(kv_cache_dtype: str) -> KVCacheFormat:
    """The format of a kv_cache_dtype name (vLLM's names; "fp8" means "fp8_e4m3")."""
    name = KV_CACHE_ALIASES.get(kv_cache_dtype, kv_cache_dtype)
    if not isinstance(kv_cache_dtype, str) or name not in KV_CACHE_FORMATS:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                         f"{kv_cache_dtype!r}")
    return KV_CACHE_FORMATS[name]


def round_half_up(y: torch.Tensor) -> torch.Tensor:
    return torch.floor(y + 0.5)


# --8<-- [start:fp8]
def quantize_fp8(x: torch.Tensor, scale: torch.Tensor,
                 fmt: KVCacheFormat) -> torch.Tensor:
    """x [...] -> fp8 [...]: x / scale, clipped to the format's range (saturate, never
    inf/NaN), then rounded to the nearest fp8 value. scale: [1] float32, the layer's
    k_scale or v_scale."""
    y = x.float() / scale  # [...]
    return y.clamp(-fmt.qmax, fmt.qmax).to(fmt.storage_dtype)


def dequantize_fp8(data: torch.Tensor, scale: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    return (data.float() * scale).to(dtype)
# --8<-- [end:fp8]


# --8<-- [start:per_token_head]
def quantize_per_token_head(x: torch.Tensor, fmt: KVCacheFormat
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (data, scales): per row (a token's K or V for one KV head).

    int8, symmetric: scale = largest |x| / 127, scales [...]. int4, asymmetric: scale =
    (max - min) / 15 and zero = min, scales [..., 2] = (scale, zero). Both are rounded
    to bfloat16 (what is stored) before the values are quantized with them, so that
    dequantizing is off by at most half a step, |x - x̂| <= scale / 2 (int4: plus the
    zero's bf16 rounding). A row of equal values (all zeros, say) gets scale 1.
    int8: data int8 [..., head_dim]; int4: data uint8 [..., head_dim / 2], two values
    per byte.
    """
    x = x.float()
    if fmt.zero_point:
        low = x.amin(dim=-1)  # [...]
        scale = ((x.amax(dim=-1) - low) / fmt.qmax).to(SCALE_DTYPE)
        zero = low.to(SCALE_DTYPE)
    else:
        scale = (x.abs().amax(dim=-1) / fmt.qmax).to(SCALE_DTYPE)  # [...]
        zero = torch.zeros_like(scale)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    # [..., head_dim]
    q = round_half_up((x - zero.float()[..., None]) / scale.float()[..., None])
    if fmt.values_per_byte == 1:
        return q.clamp(-fmt.qmax, fmt.qmax).to(torch.int8), scale
    half = x.shape[-1] // 2
    nibbles = q.clamp(0, fmt.qmax).to(torch.uint8)  # [..., hd], each in 0..15
    packed = nibbles[..., :half] | (nibbles[..., half:] << 4)  # [..., hd / 2]
    return packed, torch.stack([scale, zero], dim=-1)  # scales [..., 2]


def dequantize_per_token_head(data: torch.Tensor, scales: torch.Tensor,
                              fmt: KVCacheFormat, dtype: torch.dtype) -> torch.Tensor:
    """(data [..., stored], scales [...] or int4's [..., 2]) -> [..., head_dim] in
    dtype."""
    if fmt.values_per_byte == 1:
        return (data.float() * scales.float()[..., None]).to(dtype)
    # the low nibbles are the first half
    q = torch.cat([data & 0xF, data >> 4], dim=-1).float()
    scale, zero = scales.float().unbind(-1)  # [...] each
    return (q * scale[..., None] + zero[..., None]).to(dtype)
# --8<-- [end:per_token_head]


# --8<-- [start:hadamard]
def hadamard(head_dim: int, device=None) -> torch.Tensor:
    """An orthogonal [head_dim, head_dim] matrix whose rows spread every channel over all
    channels: Sylvester's Hadamard matrix / sqrt(n), for the largest power of two n dividing
    head_dim, repeated block-diagonally (head_dim 64: one 64 x 64 block; 80: five of 16). It is
    symmetric, so it is its own inverse: x @ H @ H = x."""
    n = head_dim & -head_dim  # the largest power of two dividing head_dim
    block = torch.ones(1, 1)
    while block.shape[0] < n:
        block = torch.cat([torch.cat([block, block], 1), torch.cat([block, -block], 1)], 0)
    return torch.block_diag(*[block / n**0.5] * (head_dim // n)).to(device)
# --8<-- [end:hadamard]


# --8<-- [start:dispatch]
def quantize_kv(x: torch.Tensor, kv_cache_dtype: str, scale: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [T, kv_heads, head_dim] -> (what the cache stores, the per-token-head scales or
    None). fp8 takes the layer's per-tensor scale."""
    fmt = kv_cache_format(kv_cache_dtype)
    if fmt.scales == "none":
        return x, None
    if fmt.scales == "per_tensor":
        return quantize_fp8(x, scale, fmt), None
    return quantize_per_token_head(x, fmt)


def dequantize_kv(data: torch.Tensor, scale: torch.Tensor | None, kv_cache_dtype: str,
                  dtype: torch.dtype) -> torch.Tensor:
    """What the cache stores (rows [..., stored]) -> values [..., head_dim] in dtype.
    scale: the rows' per-token-head scales [...], or the layer's per-tensor scale [1]
    for fp8."""
    fmt = kv_cache_format(kv_cache_dtype)
    if fmt.scales == "none":
        return data.to(dtype)
    if fmt.scales == "per_tensor":
        return dequantize_fp8(data, scale, dtype)
    return dequantize_per_token_head(data, scale, fmt, dtype)
# --8<-- [end:dispatch]


def calculated_scale(x: torch.Tensor, constant: float) -> torch.Tensor:
    """fp8's per-tensor scale from a calibration batch x: largest |x| / constant ([1] float32;
    1.0 when the batch is all zeros)."""
    return scale_of_amax(absmax(x), constant)


def absmax(x: torch.Tensor) -> torch.Tensor:
    """Largest |x| of a batch ([1] float32; 0 for an empty one)."""
    return x.float().abs().amax().reshape(1) if x.numel() else torch.zeros(1, device=x.device)


def scale_of_amax(amax: torch.Tensor, constant: float) -> torch.Tensor:
    return torch.where(amax > 0, amax / constant, torch.ones_like(amax))


# --8<-- [start:quant]
@dataclass
class KVCacheQuant:
    """How the pool stores its values (``ops/kv_quant.py``) and their scales, per layer.

    kv_cache_dtype "auto" has none. fp8: k_scales[layer], v_scales[layer] are [1]
    float32, 1.0 or, with calculate_scales, set from the K/V of the first forward (the
    engine clears the flag once that forward has finished: a failed one leaves it set,
    so no layer keeps a scale from a batch that was thrown away). int8 / int4:
    [num_blocks, block_size, kv_heads] bfloat16 (int4: [..., 2], scale and zero), per
    slot and KV head, written by store_kv with the values. int4 also has a rotation H:
    the context stores k H and v H, attends with q H (the scores are unchanged, H is
    orthogonal) and rotates the output back.
    """

    kv_cache_dtype: str = "auto"
    k_scales: list[torch.Tensor] = field(default_factory=list)
    v_scales: list[torch.Tensor] = field(default_factory=list)
    calculate_scales: bool = False
    # int4: the Hadamard matrix [head_dim, head_dim]
    rotation: torch.Tensor | None = None
    # Tensor parallelism: an in-place max over the ranks, so that every rank
    # calibrates from the largest |K| and |V| of all KV heads, as one rank holding
    # them all would.
    reduce_max: Callable[[torch.Tensor], None] | None = None

    @property
    def scales_per_tensor(self) -> bool:
        return kv_cache_format(self.kv_cache_dtype).scales == "per_tensor"

    def args(self, layer: int) -> tuple:
        """(kv_cache_dtype, k_scale, v_scale): the trailing arguments of store_kv and
        paged_attention for this layer; none for "auto"."""
        if self.kv_cache_dtype == "auto":
            # nothing to add: an op written for unquantized caches works unchanged
            return ()
        return (self.kv_cache_dtype, self.k_scales[layer], self.v_scales[layer])

    def calibrate(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """fp8's calculate_kv_scales: this layer's scales from the batch's real K/V
        rows."""
        amax = torch.cat([absmax(k), absmax(v)])  # [2]
        if self.reduce_max is not None:
            self.reduce_max(amax)
        self.k_scales[layer].copy_(scale_of_amax(amax[:1], K_SCALE_CONSTANT))
        self.v_scales[layer].copy_(scale_of_amax(amax[1:], V_SCALE_CONSTANT))
# --8<-- [end:quant]
