"""The quantized KV cache's definitions: round-trip error bounds stated from each format, and
attention over a quantized pool equal to attention over the values it stores.

The bounds come from the formats, not from fitted numbers:
- int8 (symmetric, one bfloat16 scale s per token and head): |x - x̂| <= s / 2, and s is the
  row's largest |x| / 127 rounded to bfloat16 (relative error <= 2**-8);
- int4 (asymmetric: scale s = (max - min) / 15 and zero z = min, both bfloat16):
  |x - x̂| <= s / 2 + (|min| + 15 s) * 2**-7 (+ 2**-133 for bfloat16 subnormals) — half a
  step, plus what rounding z and s to bfloat16 can push a row's extremes past the 16 levels;
- fp8 (per-tensor scale c): y = x / c is stored as the nearest fp8 value, so |y - ŷ| is at most
  half a step: |y| * 2**-(mantissa + 1) in the normal range, 2**(min_exp - mantissa - 1) in the
  subnormal range, and values beyond the largest (448 for e4m3) are clipped to it.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.reference.kv import CacheEngine
from pagedllm.reference.ops import (
    dequantize_kv,
    kv_cache_format,
    paged_attention,
    quantize_kv,
    store_kv,
)
from pagedllm.reference.ops.kv_quant import KV_CACHE_FORMATS, calculated_scale, hadamard

INT_FORMATS = ("int8", "int4")
FP8_FORMATS = ("fp8_e4m3", "fp8_e5m2")
FP8_BITS = {"fp8_e4m3": (3, -6), "fp8_e5m2": (2, -14)}  # (mantissa bits, smallest normal exponent)


def adversarial_rows(head_dim: int = 16) -> torch.Tensor:
    """[R, 1, head_dim]: zeros, negative zeros, one huge outlier, subnormals, mixed scales."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.zeros(head_dim), torch.full((head_dim,), -0.0),
            torch.cat([torch.tensor([1e4]), torch.randn(head_dim - 1, generator=g)]),
            torch.cat([torch.randn(head_dim - 1, generator=g), torch.tensor([-3e5])]),
            torch.full((head_dim,), 1e-40),  # float32 subnormals
            torch.randn(head_dim, generator=g) * 1e-30,
            torch.randn(head_dim, generator=g) * 1e6,
            torch.linspace(-1, 1, head_dim)]
    return torch.stack(rows)[:, None, :]


def check_int_bound(x: torch.Tensor, name: str) -> None:
    fmt = kv_cache_format(name)
    data, scales = quantize_kv(x, name)
    assert data.dtype == fmt.storage_dtype and data.shape[-1] == fmt.storage_head_dim(x.shape[-1])
    assert scales.dtype == torch.bfloat16
    back = dequantize_kv(data, scales, name, torch.float32)
    if fmt.zero_point:
        assert scales.shape == (*x.shape[:-1], 2)
        s, z = (t[..., None] for t in scales.float().unbind(-1))
        low = x.amin(-1, keepdim=True)
        span = x.amax(-1, keepdim=True) - low
        # bfloat16's relative rounding, and below its normal range its smallest step (2**-133)
        assert torch.all((z - low).abs() <= low.abs() * 2**-8 + 2**-133)
        bound = s / 2 + (low.abs() + 15 * s) * 2**-7 + 2**-133
    else:
        assert scales.shape == x.shape[:-1]
        s = scales.float()[..., None]
        span = x.abs().amax(-1, keepdim=True)
        bound = s / 2
    assert torch.all((x - back).abs() <= bound * (1 + 2**-20)), name
    normal = span / fmt.qmax > 2**-126  # the scale is a normal bfloat16: relative rounding only
    assert torch.all(torch.where(normal, (s - span / fmt.qmax).abs() <= span / fmt.qmax * 2**-8,
                                 True))


def check_fp8_bound(x: torch.Tensor, name: str, c: float) -> None:
    fmt = kv_cache_format(name)
    mantissa, min_exp = FP8_BITS[name]
    c = torch.tensor([c])
    data, _ = quantize_kv(x, name, c)
    assert data.dtype == fmt.storage_dtype
    back = dequantize_kv(data, c, name, torch.float32)
    y = x / c
    clipped = y.clamp(-fmt.qmax, fmt.qmax)
    half_step = torch.maximum(clipped.abs() * 2.0 ** -(mantissa + 1),
                              torch.tensor(2.0 ** (min_exp - mantissa - 1)))
    assert torch.all((clipped - back / c).abs() <= half_step * (1 + 2**-20)), name
    assert torch.isfinite(back).all(), "out-of-range values saturate, never inf or NaN"


@pytest.mark.parametrize("name", INT_FORMATS)
def test_int_round_trip_bound_on_adversarial_rows(name):
    check_int_bound(adversarial_rows(), name)


@pytest.mark.parametrize("name", FP8_FORMATS)
@pytest.mark.parametrize("c", [1.0, 0.01, 37.5])
def test_fp8_round_trip_bound_on_adversarial_rows(name, c):
    check_fp8_bound(adversarial_rows(), name, c)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([*INT_FORMATS, *FP8_FORMATS]), st.integers(1, 6),
       st.sampled_from([2, 8, 64]), st.floats(-30, 30), st.integers(0, 2**31 - 1))
def test_round_trip_bound_on_random_rows(name, heads, head_dim, log_scale, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, heads, head_dim, generator=g) * 2.0**log_scale
    if name in INT_FORMATS:
        check_int_bound(x, name)
    else:
        check_fp8_bound(x, name, 1.0)


def test_zeros_and_negative_zero_come_back_as_zero():
    x = torch.tensor([[[0.0, -0.0, 0.0, -0.0]]])
    for name in (*INT_FORMATS, *FP8_FORMATS):
        data, scale = quantize_kv(x, name, torch.ones(1))
        assert torch.equal(dequantize_kv(data, scale if scale is not None else torch.ones(1),
                                         name, torch.float32).abs(), x.abs())


def test_int4_packs_the_two_halves_of_a_row_into_one_byte():
    x = torch.tensor([[[-7.0, 8.0, 0.0, 1.0, 2.0, 3.0, -1.0, 5.0]]])  # min -7, max 8: step 1
    data, scales = quantize_kv(x, "int4")
    assert scales.tolist() == [[[1.0, -7.0]]] and data.shape == (1, 1, 4)
    low, high = (data & 0xF).int(), (data >> 4).int()  # level = value - min
    assert low.tolist() == [[[0, 15, 7, 8]]] and high.tolist() == [[[9, 10, 6, 12]]]


@pytest.mark.parametrize("head_dim", [64, 80, 6])
def test_hadamard_is_orthogonal_and_its_own_inverse(head_dim):
    H = hadamard(head_dim)
    torch.testing.assert_close(H @ H, torch.eye(head_dim), atol=1e-6, rtol=0)
    assert torch.equal(H, H.T)
    x = torch.zeros(head_dim)
    x[3] = 10.0  # one large channel ...
    assert (x @ H).abs().max() <= 10.0 / 2**0.5 * (1 + 1e-6)  # ... spread over two or more


def test_names_and_bytes():
    assert kv_cache_format("fp8") is KV_CACHE_FORMATS["fp8_e4m3"]  # vLLM's alias
    with pytest.raises(ValueError, match="auto, fp8_e4m3, fp8_e5m2, int8, int4"):
        kv_cache_format("int3")
    assert kv_cache_format("fp16") is KV_CACHE_FORMATS["float16"]
    assert kv_cache_format("bf16") is KV_CACHE_FORMATS["bfloat16"]
    # head_dim 64 (SmolLM2): bf16 128 bytes; int8 64 + a 2-byte scale; int4 32 + scale and zero;
    # the 16-bit caches 128 whatever the model's dtype (a float32 model's cache halves).
    assert [KV_CACHE_FORMATS[n].bytes_per_token_head(64, 2) for n in KV_CACHE_FORMATS] == \
        [128, 64, 64, 66, 36, 128, 128]
    assert KV_CACHE_FORMATS["float16"].bytes_per_token_head(64, 4) == 128


def test_calculated_scale_maps_the_batch_into_range():
    k = torch.tensor([[[600.0, -2.0]]])
    assert calculated_scale(k, 200.0).item() == pytest.approx(3.0)
    assert calculated_scale(torch.zeros(2, 1, 2), 200.0).item() == 1.0  # nothing to calibrate
    assert calculated_scale(torch.zeros(0, 1, 2), 200.0).item() == 1.0


# -- attention over a quantized pool -----------------------------------------------------------
HEADS, KV_HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS = 4, 2, 8, 4, 16


def quantized_pool(name, seq_lens):
    """A pool in `name` holding random K/V for the sequences (blocks interleaved, the unused
    slots NaN-poisoned), and the same values dequantized in a float32 pool."""
    cache = CacheEngine(1, KV_HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS, kv_cache_dtype=name)
    cache.fill_(float("nan"))
    plain = CacheEngine(1, KV_HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS)
    plain.fill_(float("nan"))
    if cache.quant.scales_per_tensor:
        cache.quant.k_scales[0].fill_(0.02)
        cache.quant.v_scales[0].fill_(0.05)
    width = -(-max(seq_lens) // BLOCK)
    tables = torch.tensor([[b * len(seq_lens) + i for b in range(width)]
                           for i in range(len(seq_lens))], dtype=torch.int32)
    for i, n in enumerate(seq_lens):
        k, v = torch.randn(n, KV_HEADS, HEAD_DIM) * 3, torch.randn(n, KV_HEADS, HEAD_DIM)
        slots = tables[i].long()[torch.arange(n) // BLOCK] * BLOCK + torch.arange(n) % BLOCK
        store_kv(k, v, cache.gpu_k[0], cache.gpu_v[0], slots, *cache.quant.args(0))
        args = cache.quant.args(0)
        for src, dst, scale in ((cache.gpu_k[0], plain.gpu_k[0], args[1]),
                                (cache.gpu_v[0], plain.gpu_v[0], args[2])):
            rows = src.view(-1, KV_HEADS, src.shape[-1])[slots]
            scales = scale if cache.quant.scales_per_tensor else \
                scale.view(-1, *scale.shape[2:])[slots]
            dst.view(-1, KV_HEADS, HEAD_DIM)[slots] = dequantize_kv(rows, scales, name,
                                                                    torch.float32)
    return cache, plain, tables


@pytest.mark.parametrize("name", [*INT_FORMATS, *FP8_FORMATS])
@pytest.mark.parametrize("q_lens", [(1, 1, 1), (5, 1, 3), (9, 2, 1)])
def test_attention_reads_the_dequantized_values_and_no_unused_slot(name, q_lens):
    """Decodes, prompts and chunks over a quantized pool give what attention over the stored
    values gives; NaN scales (or NaN fp8 bytes) in unused slots never reach the output."""
    seq_lens = (9, 13, 6)
    cache, plain, tables = quantized_pool(name, seq_lens)
    q = torch.randn(sum(q_lens), HEADS, HEAD_DIM)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens)
    out = paged_attention(q, cache.gpu_k[0], cache.gpu_v[0], tables, lens, starts, 0.35, None,
                          *cache.quant.args(0))
    want = paged_attention(q, plain.gpu_k[0], plain.gpu_v[0], tables, lens, starts, 0.35)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", INT_FORMATS)
def test_block_moves_carry_the_scales(name):
    cache = CacheEngine(2, KV_HEADS, HEAD_DIM, BLOCK, 4, num_cpu_blocks=4, kv_cache_dtype=name)
    for layer in range(2):
        k = torch.randn(BLOCK, KV_HEADS, HEAD_DIM) * (layer + 1)
        store_kv(k, -k, cache.gpu_k[layer], cache.gpu_v[layer], torch.arange(BLOCK),
                 *cache.quant.args(layer))
    before = [t[0].clone() for t in (*cache.quant.k_scales, *cache.quant.v_scales)]
    cache.apply([], [], [(0, 2)])  # copy-on-write: block 2 becomes block 0, scales too
    assert all(torch.equal(t[2], b) for t, b in
               zip((*cache.quant.k_scales, *cache.quant.v_scales), before, strict=True))
    cache.apply([(0, 3)], [], [])  # swap out to CPU block 3 ...
    for t in (*cache.quant.k_scales, *cache.quant.v_scales):
        t[0].zero_()
    cache.apply([], [(3, 1)], [])  # ... and in to GPU block 1
    assert all(torch.equal(t[1], b) for t, b in
               zip((*cache.quant.k_scales, *cache.quant.v_scales), before, strict=True))
