"""Checks lesson 17's exercise: int8 / int4 rows with one scale each, and attention over them.

    pytest lessons/exercises/test_kv_quant_exercise.py

Each test runs twice: against the solution (always) and against your file,
lessons/exercises/kv_quant_exercise.py (skipped while a function it needs still raises
NotImplementedError). conftest.py loads both by file path, so lessons/ needs no __init__.py.

The bounds come from the formats. int8: x / s is rounded to the nearest integer, so it moves by
half a step at most, and a step is s: |x - x_hat| <= s / 2. int4: the same half step, plus what
rounding z and s to bfloat16 can push a row's extremes past the 16 levels (they are clipped):
|x - x_hat| <= s / 2 + (|min| + 15 s) * 2**-7. The reference is reference/ops/kv_quant.py
(quantize_kv, dequantize_kv) and the engine's paged attention (reference/ops/attention.py),
which a pool written with your quantizer must serve exactly as one written by store_kv.
"""

import pytest
import torch

from pagedllm.reference.kv import CacheEngine
from pagedllm.reference.ops import (
    causal_attention,
    dequantize_kv,
    gather_kv,
    paged_attention,
    quantize_kv,
    store_kv,
)

EXERCISE = "kv_quant_exercise"  # impl (conftest.py): the solution's file, then yours
NAMES = ("int8", "int4")


@pytest.fixture
def quantize(impl):
    return impl.use("quantize_rows", torch.ones(1, 1, 4), "int8")


@pytest.fixture
def dequantize(impl):
    return impl.use("dequantize_rows", torch.ones(1, 1, 4, dtype=torch.int8),
                    torch.ones(1, 1, dtype=torch.bfloat16), "int8", torch.float32)


def rows(head_dim: int = 16) -> torch.Tensor:
    """[R, 2, head_dim]: zeros, negative zeros, an outlier, tiny and huge rows, random rows."""
    g = torch.Generator().manual_seed(0)
    special = [torch.zeros(head_dim), torch.full((head_dim,), -0.0),
               torch.cat([torch.tensor([1e4]), torch.randn(head_dim - 1, generator=g)]),
               torch.cat([torch.randn(head_dim - 1, generator=g), torch.tensor([-3e5])]),
               torch.randn(head_dim, generator=g) * 1e-30,
               torch.randn(head_dim, generator=g) * 1e6,
               torch.linspace(-1, 1, head_dim)]
    scaled = [torch.randn(head_dim, generator=g) * 2.0 ** e for e in range(-20, 21, 4)]
    return torch.stack(special + scaled).view(-1, 2, head_dim)  # pairs of rows: 2 KV heads


def test_int8_round_trip_is_off_by_at_most_half_a_step(quantize, dequantize):
    x = rows()
    data, scale = quantize(x, "int8")
    assert data.dtype == torch.int8 and data.shape == x.shape, (
        "int8 stores int8 [..., head_dim]"
        "\nint8은 int8 [..., head_dim]으로 저장합니다")
    assert scale.dtype == torch.bfloat16 and scale.shape == x.shape[:-1], (
        "one bfloat16 scale per row"
        "\n행마다 bfloat16 스케일 하나")
    back = dequantize(data, scale, "int8", torch.float32)
    assert back.shape == x.shape and back.dtype == torch.float32
    s = scale.float()[..., None]
    assert torch.all((x - back).abs() <= s / 2 * (1 + 2**-20)), "|x - x_hat| > s / 2"
    amax = x.abs().amax(-1)
    assert torch.all(scale[amax == 0] == 1), ("a row of zeros takes the scale 1"
                                              "\n0만 있는 행의 스케일은 1입니다")
    # The stored scale is amax / 127 rounded to bfloat16: within bfloat16's rounding of it.
    nonzero = amax > 0
    exact = amax[nonzero] / 127
    assert torch.all((scale.float()[nonzero] - exact).abs() <= exact * 2**-8)


def test_int4_round_trip_is_off_by_at_most_half_a_step(quantize, dequantize):
    x = rows()
    data, scales = quantize(x, "int4")
    assert data.dtype == torch.uint8 and data.shape == (*x.shape[:-1], 8), (
        "int4 stores uint8 [..., head_dim / 2]: two values per byte"
        "\nint4는 uint8 [..., head_dim / 2]로 저장합니다: 바이트당 값 두 개")
    assert scales.dtype == torch.bfloat16 and scales.shape == (*x.shape[:-1], 2), (
        "a bfloat16 (scale, zero) per row: scales [..., 2]"
        "\n행마다 bfloat16 (scale, zero) 하나: scales [..., 2]")
    back = dequantize(data, scales, "int4", torch.float32)
    assert back.shape == x.shape and back.dtype == torch.float32
    s, z = (t[..., None] for t in scales.float().unbind(-1))
    low = x.amin(-1, keepdim=True)
    span = x.amax(-1, keepdim=True) - low
    assert torch.all((z - low).abs() <= low.abs() * 2**-8 + 2**-133), (
        "the zero is the row's min"
        "\n영점은 행의 최솟값입니다")
    assert torch.all(s[span == 0] == 1), ("a row of equal values takes the scale 1"
                                          "\n값이 모두 같은 행의 스케일은 1입니다")
    nonzero = span > 0
    exact = span[nonzero] / 15
    assert torch.all((s[nonzero] - exact).abs() <= exact * 2**-8), (
        "the scale is (max - min) / 15"
        "\n스케일은 (max - min) / 15입니다")
    bound = s / 2 + (low.abs() + 15 * s) * 2**-7 + 2**-133
    assert torch.all((x - back).abs() <= bound * (1 + 2**-20)), (
        "|x - x_hat| > half a step"
        "\n|x - x_hat| > 반 간격")


def test_rounding_is_half_up_and_int4_packs_the_halves(quantize):
    # largest |x| = 127: the int8 scale is exactly 1, and x / s is x itself.
    x8 = torch.tensor([[[127.0, 2.5, -2.5, 0.5, -0.5, 1.5, 0.0, -127.0]]])
    data, scale = quantize(x8, "int8")
    assert scale.item() == 1.0
    assert data.tolist() == [[[127, 3, -2, 1, 0, 2, 0, -127]]], (
        "round half up: floor(x / s + 0.5) (torch.round gives 2.5 -> 2)"
        "\n0.5는 올림: floor(x / s + 0.5) (torch.round는 2.5 -> 2를 줍니다)")
    # min -7, max 8: the int4 scale is exactly 1 and the zero -7, so the levels are x + 7.
    x4 = torch.tensor([[[-7.0, 8.0, -4.5, -6.5, 0.5, -1.5, 2.0, 3.0]]])
    data, scales = quantize(x4, "int4")
    assert scales.tolist() == [[[1.0, -7.0]]]
    assert data.dtype == torch.uint8 and data.shape == (1, 1, 4)
    # levels 0, 15, 3, 1 | 8, 6, 9, 10 (2.5 -> 3, 0.5 -> 1, 7.5 -> 8, 5.5 -> 6): the first half
    # in the low nibbles, the second half in the high ones
    assert data.tolist() == [[[0 | 8 << 4, 15 | 6 << 4, 3 | 9 << 4, 1 | 10 << 4]]], (
        "byte j: level j in the low 4 bits, level j + head_dim/2 in the high 4, half up"
        "\n바이트 j: 하위 4비트에 단계 j, 상위 4비트에 단계 j + head_dim/2, 0.5는 올림")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_your_bytes_are_the_references(quantize, dequantize, name, dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(37, 3, 64, generator=g) * torch.rand(37, 3, 1, generator=g) * 8).to(dtype)
    data, scale = quantize(x, name)
    want_data, want_scale = quantize_kv(x, name)
    assert torch.equal(scale, want_scale), ("scales differ from the reference's"
                                            "\n스케일이 레퍼런스와 다릅니다")
    assert torch.equal(data, want_data), ("stored values differ from the reference's"
                                          "\n저장된 값이 레퍼런스와 다릅니다")
    torch.testing.assert_close(dequantize(want_data, want_scale, name, dtype),
                               dequantize_kv(want_data, want_scale, name, dtype), rtol=0, atol=0)


# -- attention over a pool written with your quantizer ------------------------------------------
HEADS, KV_HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS = 4, 2, 16, 4, 24
SEQ_LENS, Q_LENS = (9, 13, 6, 1), (1, 5, 6, 1)  # a decode, a chunk, a whole prompt, one token


def pools(name):
    """Two pools in `name` (unused slots NaN-poisoned), block tables that interleave the
    sequences, and the K/V to store."""
    ours, theirs = (CacheEngine(1, KV_HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS, kv_cache_dtype=name)
                    for _ in range(2))
    ours.fill_(float("nan"))
    theirs.fill_(float("nan"))
    width = -(-max(SEQ_LENS) // BLOCK)
    tables = torch.tensor([[b * len(SEQ_LENS) + i for b in range(width)]
                           for i in range(len(SEQ_LENS))], dtype=torch.int32)
    g = torch.Generator().manual_seed(7)
    kv = [(torch.randn(n, KV_HEADS, HEAD_DIM, generator=g) * 3,
           torch.randn(n, KV_HEADS, HEAD_DIM, generator=g)) for n in SEQ_LENS]
    return ours, theirs, tables, kv


def slots_of(table: torch.Tensor, n: int) -> torch.Tensor:
    positions = torch.arange(n)
    return table.long()[positions // BLOCK] * BLOCK + positions % BLOCK  # [n]


def store_with(quantize, name, k, v, cache: CacheEngine, slots: torch.Tensor) -> None:
    """store_kv's job, with your quantizer: values and scales at the same slots."""
    for x, values, scales in ((k, cache.gpu_k[0], cache.quant.k_scales[0]),
                              (v, cache.gpu_v[0], cache.quant.v_scales[0])):
        data, row_scales = quantize(x, name)  # [n, kv_heads, stored], [n, kv_heads(, 2)]
        values.view(-1, KV_HEADS, values.shape[-1])[slots] = data
        scales.view(-1, *scales.shape[2:])[slots] = row_scales


def attend_with(dequantize, name, q, cache: CacheEngine, tables, starts) -> torch.Tensor:
    """paged_attention's prompt path (gather, dequantize, attend), with your dequantizer."""
    out = torch.zeros_like(q)
    for b, seq_len in enumerate(SEQ_LENS):
        k, v = (dequantize(gather_kv(values, tables[b], seq_len),
                           gather_kv(scales, tables[b], seq_len), name, q.dtype)
                for values, scales in ((cache.gpu_k[0], cache.quant.k_scales[0]),
                                       (cache.gpu_v[0], cache.quant.v_scales[0])))
        positions = torch.arange(seq_len)
        rows = slice(starts[b], starts[b + 1])
        out[rows] = causal_attention(q[rows], k, v, positions[seq_len - Q_LENS[b]:], positions,
                                     HEAD_DIM ** -0.5)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_paged_attention_over_your_cache_is_the_references(quantize, dequantize, name):
    ours, theirs, tables, kv = pools(name)
    for i, (k, v) in enumerate(kv):
        slots = slots_of(tables[i], SEQ_LENS[i])
        store_with(quantize, name, k, v, ours, slots)
        store_kv(k, v, theirs.gpu_k[0], theirs.gpu_v[0], slots, *theirs.quant.args(0))
    q = torch.randn(sum(Q_LENS), HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    starts = [0, *torch.tensor(Q_LENS).cumsum(0).tolist()]
    args = (tables, torch.tensor(SEQ_LENS), torch.tensor(starts, dtype=torch.int32),
            HEAD_DIM ** -0.5, None)
    want = paged_attention(q, theirs.gpu_k[0], theirs.gpu_v[0], *args, *theirs.quant.args(0))
    assert torch.isfinite(want).all()
    # Your bytes, read by the engine's attention (its dequantize)...
    got = paged_attention(q, ours.gpu_k[0], ours.gpu_v[0], *args, *ours.quant.args(0))
    torch.testing.assert_close(got, want, rtol=0, atol=0,
                               msg=("attention over your stored cache differs"
                                    "\n여러분이 저장한 캐시 위의 어텐션이 다릅니다"))
    # ... and the reference's bytes, read with your dequantize.
    got = attend_with(dequantize, name, q, theirs, tables, starts)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6,
                               msg=("attention read through your dequantize differs"
                                    "\n여러분의 dequantize로 읽은 어텐션이 다릅니다"))
