"""Checks lesson 18's exercise: int4 weights in groups, a scale and a zero point per group.

    pytest lessons/exercises/test_weight_quant_exercise.py

Each test runs twice: against the solution (always) and against your file,
lessons/exercises/weight_quant_exercise.py (skipped while a function it needs still raises
NotImplementedError). conftest.py loads both by file path, so lessons/ needs no __init__.py.

The reference is reference/ops/weight_quant.py (quantize_int4, dequantize_weight), whose layout
torch's int4 kernel reads (optimized/quant_layers.py). The round-trip bound comes from the
format: a weight inside its group's range is rounded to the nearest of 16 levels, so it moves
by half a step, s / 2, at most; storing s and z in the weight's dtype (machine epsilon eps) can
push a group's extremes past the first or last level, by at most eps * (|z| + 8 s).
"""

import pytest
import torch

from pagedllm.optimized.quant_layers import Int4PackedLinear
from pagedllm.reference.model.quantization import QuantizedLinear
from pagedllm.reference.ops.weight_quant import (
    QuantizedWeight,
    dequantize_weight,
    quantize_int4,
    quantized_linear,
)

EXERCISE = "weight_quant_exercise"  # impl (conftest.py): the solution's file, then yours
GROUPS = (32, 64, 128)
DTYPES = (torch.float32, torch.bfloat16)


@pytest.fixture
def quantize(impl):
    return impl.use("quantize_int4", torch.ones(2, 32), 32)


@pytest.fixture
def dequantize(impl):
    return impl.use("dequantize_int4", torch.zeros(2, 16, dtype=torch.uint8), torch.ones(2, 1),
                    torch.zeros(2, 1), 32, torch.float32)


def weights(out: int = 24, inp: int = 256, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[out, inp]: rows of very different sizes, a row far from zero (a symmetric grid would
    waste half its levels on it), a row of zeros and a column of outliers."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out, inp, generator=g) * torch.logspace(-4, 1, out)[:, None]
    w[3] += 2.0
    w[5] = 0.0
    w[:, 7] *= 30
    return w.to(dtype)


def codes_of(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in / 2] -> the codes [out, in]: byte i holds input 2i low, 2i + 1 high."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).view(packed.shape[0], -1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", GROUPS)
def test_your_codes_scales_and_zeros_are_the_references(quantize, dtype, group_size):
    w = weights(dtype=dtype)
    packed, scales, zeros = quantize(w, group_size)
    assert packed.dtype == torch.uint8 and packed.shape == (24, 128), (
        "packed is uint8 [out, in / 2]: two codes a byte"
        "\npacked는 uint8 [out, in / 2]입니다: 바이트당 코드 두 개")
    groups = 256 // group_size
    assert scales.shape == zeros.shape == (24, groups), (
        "one scale and one zero per group"
        "\n그룹마다 스케일 하나와 영점 하나")
    assert scales.dtype == zeros.dtype == dtype, ("scales and zeros are stored in w's dtype"
                                                  "\nscales와 zeros는 w의 dtype으로 저장합니다")
    want = quantize_int4(w, group_size)
    assert torch.equal(scales, want.scales), ("scales differ: (max - min) / 15, as stored"
                                              "\n스케일이 다릅니다: (max - min) / 15를 저장 "
                                              "dtype으로 반올림한 값")
    assert torch.equal(zeros, want.zeros), ("zeros differ: min + 8 * (the stored scale)"
                                            "\n영점이 다릅니다: min + 8 * (저장된 스케일)")
    assert torch.equal(codes_of(packed), codes_of(want.qweight)), (
        "codes differ: torch.round((w - z) / s) + 8 with s and z as stored, clipped to 0..15"
        "\n코드가 다릅니다: 저장된 s와 z로 계산한 torch.round((w - z) / s) + 8을 0..15로 클리핑")
    assert torch.equal(packed, want.qweight), ("same codes, other bytes: the packing differs"
                                               "\n코드는 같은데 바이트가 다릅니다: 패킹이 "
                                               "다릅니다")


def test_two_codes_a_byte_even_input_low(quantize, dequantize):
    # One group of 32 with min 0 and max 15: s = 1 and z = 8 exactly, so each code is the value.
    values = [3, 10, 0, 15, 7, 8, 1, 14, 2, 13, 4, 11, 5, 12, 6, 9] * 2
    w = torch.tensor([values], dtype=torch.float32)
    packed, scales, zeros = quantize(w, 32)
    assert scales.tolist() == [[1.0]] and zeros.tolist() == [[8.0]]
    want = [values[2 * i] | values[2 * i + 1] << 4 for i in range(16)]
    assert packed.tolist() == [want], (
        "byte i: the code of input 2i in the low 4 bits, of input 2i + 1 in the high 4 bits"
        "\n바이트 i: 하위 4비트에 입력 2i의 코드, 상위 4비트에 입력 2i + 1의 코드")
    assert packed[0, 0].item() == 3 + (10 << 4)
    assert dequantize(packed, scales, zeros, 32, torch.float32).tolist() == [values], (
        "(q - 8) * s + z, with the nibbles back in input order"
        "\n(q - 8) * s + z, 니블은 입력 순서대로 되돌려서")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", GROUPS)
def test_round_trip_is_off_by_at_most_half_a_step(quantize, dequantize, dtype, group_size):
    w = weights(dtype=dtype)
    packed, scales, zeros = quantize(w, group_size)
    back = dequantize(packed, scales, zeros, group_size, torch.float32)
    assert back.shape == w.shape and back.dtype == torch.float32
    s, z = scales.float()[..., None], zeros.float()[..., None]  # [out, G, 1]
    eps = torch.finfo(dtype).eps
    bound = s / 2 + eps * (z.abs() + 8 * s) + 1e-30
    err = (back - w.float()).abs().view(24, -1, group_size)
    assert torch.all(err <= bound), (f"|w - w_hat| > half a step: worst {float(err.max()):.3g}"
                                     f"\n|w - w_hat| > 반 간격: 최악 {float(err.max()):.3g}")
    # Your dequantize reads the reference's bytes as dequantize_weight does.
    want = quantize_int4(w, group_size)
    for out_dtype in DTYPES:
        got = dequantize(want.qweight, want.scales, want.zeros, group_size, out_dtype)
        assert got.dtype == out_dtype, ("dequantize returns the dtype asked for"
                                        "\ndequantize는 요청받은 dtype으로 돌려줍니다")
        torch.testing.assert_close(got, dequantize_weight(want, out_dtype), rtol=1e-6,
                                   atol=1e-6 * float(w.float().abs().max()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_group_of_equal_values_comes_back_exactly(quantize, dequantize, dtype):
    w = weights(6, 128, dtype)
    w[0, :32] = 0.0  # a group of zeros
    w[1, 32:64] = 0.5
    w[2, 64:96] = -3.0
    w[3, :] = 1.25  # a whole row, every group constant
    packed, scales, zeros = quantize(w, 32)
    assert torch.isfinite(scales.float()).all() and torch.isfinite(zeros.float()).all()
    assert (scales.float() > 0).all(), (
        "max == min: the scale is clamped (finfo.tiny), never 0"
        "\nmax == min: 스케일은 하한(finfo.tiny)으로 고정되며, 절대 0이 아닙니다")
    back = dequantize(packed, scales, zeros, 32, torch.float32)
    assert torch.isfinite(back).all(), ("a group of equal values divided by a scale of 0?"
                                        "\n값이 모두 같은 그룹을 스케일 0으로 나눴나요?")
    for row, cols in ((0, slice(0, 32)), (1, slice(32, 64)), (2, slice(64, 96)),
                      (3, slice(None))):
        want = w[row, cols].float()
        torch.testing.assert_close(back[row, cols], want, rtol=0, atol=1e-10,
                                   msg=(f"row {row}: a constant group must come back as itself"
                                        f"\n행 {row}: 상수 그룹은 그대로 돌아와야 합니다"))


def test_an_outlier_coarsens_only_its_own_group(quantize, dequantize):
    w = weights(8, 256)
    plain = dequantize(*quantize(w, 64), 64, torch.float32)
    w_out = w.clone()
    w_out[:, 5] = 50.0  # one large weight per row, in group 0
    back = dequantize(*quantize(w_out, 64), 64, torch.float32)
    assert torch.equal(back[:, 64:], plain[:, 64:]), (
        "groups 1-3 changed: every group has its own scale and zero"
        "\n그룹 1-3이 바뀌었습니다: 그룹마다 자기 스케일과 영점을 가집니다")
    err_before = (plain[:, :64] - w[:, :64]).abs().amax()
    err_after = (back[:, :64] - w_out[:, :64]).abs().amax()
    assert err_after > err_before, ("the outlier's own group gets a larger step"
                                    "\n이상치가 속한 그룹은 더 큰 간격을 받습니다")


def test_a_group_size_that_does_not_divide_the_input_is_refused(quantize):
    with pytest.raises(ValueError) as caught:
        quantize(torch.randn(8, 96), 64)
    message = str(caught.value)
    assert "64" in message and "96" in message, (
        f"say which group size does not divide which input size; got {message!r}"
        f"\n어느 그룹 크기가 어느 입력 크기를 나누지 못하는지 밝히세요; 받은 메시지 {message!r}")


@pytest.mark.parametrize("rows", [1, 5])
def test_your_bytes_through_torchs_int4_kernel(quantize, rows):
    """Your layout is torch's: its packed kernel computes the twin's product from your bytes."""
    w = (weights(48, 256) * 0.05).bfloat16()
    packed, scales, zeros = quantize(w, 64)
    layer = QuantizedLinear(QuantizedWeight("int4", packed, scales, zeros, (48, 256), 64), None)
    fast = Int4PackedLinear(layer, torch.bfloat16)  # torch's _weight_int4pack_mm_for_cpu
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    want = quantized_linear(x, quantize_int4(w, 64))  # the twin, on the reference's bytes
    got = fast(x)  # [rows, 48]
    # The same float32 sums in another order, rounded once to bf16: a rounding step apart.
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-7)
