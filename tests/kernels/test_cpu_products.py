"""The CPU kernels' matrix products (``kernels/cpu/quant_linear.cpp``: ``int8_matmul``,
``int4_matmul``, ``fp8_matmul``, ``bf16_matmul``) against the twin
(``reference/ops/weight_quant.py``: dequantize, then multiply in float32), on every
instruction-set path this machine has (``use_isa``: AMX for the bf16 product, AVX-512, AVX2,
portable C++; a path the CPU lacks runs its best below), with bf16 and float32 activations, 1
to 17 rows (one row, int8's switch at 4 rows on AVX-512, the 8-row tiles full, partial and
several; AMX's tiles of up to 16 rows) and small edge shapes
(one block of 16 outputs, one group).

Tolerances: both sides sum in float32, in different orders.
- float32 x: each side is within (K + 2) float32 roundings of the exact sum of |x w| (the
  int8 or fp8 scale, applied once or to every weight, is one more), so they differ by at most
  twice that, output by output. (fp8's kernel sums the codes' values times 2^-8 and multiplies
  by 2^8 s at the end: powers of two, no rounding of their own.)
- bf16 x: each side rounds once to bf16 (at most 2^-8 of the value each); AVX-512's bf16 paths
  sum larger terms (int4's offset codes 128 + q, int8's 24-bit planes), within 2^-12 of the
  largest |x| @ |W| of the test.
"""

import pytest
import torch
from torch import nn

from pagedllm.kernels.cpu_ops import (
    ISAS,
    cpu_extension,
    cpu_isa,
    cpu_kernels,
    pack_bf16,
    pack_fp8,
    pack_int4,
    pack_int8,
    use_isa,
)
from pagedllm.optimized.quant_layers import (
    Int8PackedLinear,
    PackedBF16Linear,
    PackedEmbedding,
    PackedFp8Linear,
    PackedInt4Linear,
    PackedInt8Linear,
    pack_linears_for_cpu,
)
from pagedllm.reference.model.quantization import QuantizedLinear
from pagedllm.reference.ops.weight_quant import (
    INT4_GROUP_SIZES,
    QuantizedWeight,
    dequantize_weight,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
)

kernels = cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="the CPU kernels did not build")

ROWS = range(1, 18)
DTYPES = [torch.bfloat16, torch.float32]
U = 2.0**-24  # a float32 rounding, relative


@pytest.fixture(params=ISAS)
def path(request):
    """Runs the test on one instruction-set path: the one asked where the machine has it,
    else the machine's best (the dispatcher's choice)."""
    machine = cpu_extension().machine_isa()
    want = request.param if ISAS.index(request.param) >= ISAS.index(machine) else machine
    with use_isa(request.param) as taken:
        assert taken == want == cpu_isa()
        yield taken


@pytest.fixture(params=DTYPES, ids=["bf16", "fp32"])
def dtype(request):
    return request.param


def check(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """got [M, N] against x @ weight.T in float32 (weight: the twin's float32 weight)."""
    assert got.dtype == x.dtype and got.shape == (x.shape[0], weight.shape[0])
    want = x.float() @ weight.T
    size = x.float().abs() @ weight.abs().T  # [M, N]: sum |x w|, what the roundings scale with
    if x.dtype == torch.float32:
        bound = 2 * (x.shape[1] + 3) * U * size
        assert ((got - want).abs() <= bound).all(), (got - want).abs().max()
    else:
        torch.testing.assert_close(got.float(), want, rtol=2**-7,
                                   atol=2**-12 * size.max().item())


def twin_int4(q: QuantizedWeight) -> torch.Tensor:
    return dequantize_weight(q, torch.float32)


# -- each product against the twin ----------------------------------------------------------
@pytest.mark.parametrize("n,k", [(16, 16), (48, 48), (32, 272)])  # one block; odd counts
def test_int8_matches_the_twin(path, dtype, n, k):
    torch.manual_seed(0)
    q = quantize_int8(torch.randn(n, k) * 0.05)  # float32 scales: a float32 model's
    packed = pack_int8(q)
    for rows in ROWS:
        x = torch.randn(rows, k).to(dtype)
        check(kernels.int8_matmul(x, *packed), x, dequantize_weight(q, torch.float32))


@pytest.mark.parametrize("group_size", INT4_GROUP_SIZES)
@pytest.mark.parametrize("scales", DTYPES, ids=["bf16-scales", "fp32-scales"])
def test_int4_matches_the_twin(path, dtype, group_size, scales):
    torch.manual_seed(0)
    for n, k in [(16, group_size), (48, 2 * group_size + 256)]:  # one group; several
        w = (torch.randn(n, k) * 0.05).to(scales)
        w[3] += 1.0  # a row far from zero: zero points far from 8 s
        q = quantize_int4(w, group_size)
        packed, s, z = pack_int4(q)  # scales and zero points in bf16
        if scales == torch.float32:  # a float32 model's, read as they are (quant_layers.py)
            layer = PackedInt4Linear(QuantizedLinear(q, None), kernels)
            s, z = layer.scales, layer.zeros
            assert s.dtype == z.dtype == torch.float32
        for rows in ROWS:
            x = torch.randn(rows, k).to(dtype)
            check(kernels.int4_matmul(x, packed, s, z, group_size), x, twin_int4(q))


@pytest.mark.parametrize("n,k", [(16, 16), (48, 52), (32, 272)])  # 52: inputs in fours
def test_fp8_matches_the_twin(path, dtype, n, k):
    torch.manual_seed(0)
    w = torch.randn(n, k) * 0.05
    w[1, 0] = 30.0  # a row whose other weights fall on e4m3's subnormals (below 2**-6 x 448)
    w[2] = 0.0  # an all-zero row: the twin's clamped scale
    q = quantize_fp8(w)  # float32 scales: a float32 model's
    packed = pack_fp8(q)
    for rows in ROWS:
        x = torch.randn(rows, k).to(dtype)
        check(kernels.fp8_matmul(x, *packed), x, dequantize_weight(q, torch.float32))


def test_fp8_reads_every_code_as_the_twin_does(path):
    """Each of e4m3's 254 numbers (subnormals, zeros of both signs, 448), one product term an
    output: the kernel's value of each code times its scale, bit for bit the twin's."""
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    codes = torch.cat([codes, codes[:2]]).view(16, 16)  # [16 outputs, 16 inputs]
    scales = torch.linspace(0.5, 3.0, 16).bfloat16()  # bf16: a bf16 model's
    q = QuantizedWeight("fp8", codes.view(torch.float8_e4m3fn), scales, None, (16, 16))
    x = torch.eye(16)  # row k picks input k of every output
    got = kernels.fp8_matmul(x, *pack_fp8(q))
    assert torch.equal(got, dequantize_weight(q, torch.float32).T)


def test_a_nan_code_makes_its_output_nan_for_every_row(path, dtype):
    """As the twin's: a NaN weight (code 0x7F or 0xFF) makes its output NaN whatever x is, the
    other outputs untouched (pack_fp8 gives its row a NaN scale)."""
    torch.manual_seed(0)
    w = torch.randn(32, 64) * 0.05
    w[5, 3], w[20, 60] = float("nan"), -float("nan")
    q = quantize_fp8(w)
    assert (q.qweight.view(torch.uint8)[5] & 0x7F == 0x7F).any()
    x = torch.randn(3, 64).to(dtype)
    x[1] = 0.0  # 0 x NaN is NaN too
    got, weight = kernels.fp8_matmul(x, *pack_fp8(q)), dequantize_weight(q, torch.float32)
    want = (x.float() @ weight.T).to(dtype)
    nan = [5, 20]
    assert got[:, nan].isnan().all() and want[:, nan].isnan().all()
    keep = [i for i in range(32) if i not in nan]
    check(got[:, keep], x, weight[keep])


# K % 32 == 0: the AMX path at every row count (tiles of 16 rows x 32 inputs, 4 blocks a group,
# so 5 and 7 blocks leave groups of 1 and 3), where the machine has it
@pytest.mark.parametrize("n,k", [(16, 16), (48, 52), (32, 272), (80, 64), (112, 96)])
def test_bf16_matches_the_twin(path, dtype, n, k):
    torch.manual_seed(0)
    w = torch.randn(n, k).bfloat16()
    packed = pack_bf16(w)
    for rows in ROWS:
        x = torch.randn(rows, k).to(dtype)
        check(kernels.bf16_matmul(x, packed), x, w.float())


def test_amx_takes_every_row_of_a_prompt_where_the_machine_has_it(path):
    """On the amx path a bf16 product of K % 32 == 0 inputs runs on AMX tiles from
    bf16_amx_rows rows on, prompts included (no oneDNN, no unpacked weight); every other
    path and K says 0, and the layer sends a prompt's rows to oneDNN instead."""
    from pagedllm.optimized.quant_layers import ONEDNN_ROWS

    torch.manual_seed(0)
    amx = kernels.bf16_amx_rows(64)
    assert kernels.bf16_amx_rows(48) == 0 and (amx > 0) == (path == "amx")
    dense = nn.Linear(64, 80, bias=False).bfloat16()
    layer = PackedBF16Linear(dense, kernels)
    for rows in (amx or 4, 33, ONEDNN_ROWS + 5):
        x = torch.randn(rows, 64).bfloat16()
        got = layer(x)
        check(got, x, dense.weight.float())
        if path == "amx" or rows < ONEDNN_ROWS:  # the kernel's product, bit for bit
            assert torch.equal(got, kernels.bf16_matmul(x, layer.packed))
        else:  # oneDNN's, on the weight unpacked
            assert torch.equal(got, dense(x))


def test_a_prompt_s_rows_go_to_onednn_through_the_unpacked_weight():
    """From ONEDNN_ROWS rows a bf16 layer multiplies with F.linear on its weight unpacked from
    the kernel's pairs: bit for bit the original weight, and the product of nn.Linear."""
    from pagedllm.optimized.quant_layers import ONEDNN_ROWS

    torch.manual_seed(0)
    dense = nn.Linear(48, 32, bias=False).bfloat16()
    packed = PackedBF16Linear(dense, kernels)
    for shape in ((1, 48), (ONEDNN_ROWS - 1, 48), (ONEDNN_ROWS, 48), (3, 100, 48)):
        x = torch.randn(shape).bfloat16()  # leading dims kept
        got, want = packed(x), dense(x)
        assert got.shape == want.shape and got.dtype == torch.bfloat16
        if x.numel() // 48 >= ONEDNN_ROWS:
            assert torch.equal(got, want)  # the same oneDNN product, the same weight
        check(got.reshape(-1, 32), x.reshape(-1, 48), dense.weight.float())


# -- rows that are not finite ----------------------------------------------------------------
def _products():
    torch.manual_seed(0)
    w = torch.randn(32, 64) * 0.05
    q8, q4 = quantize_int8(w.bfloat16()), quantize_int4(w.bfloat16(), 32)
    q_fp8 = quantize_fp8(w.bfloat16())
    p8, p4, pb = pack_int8(q8), pack_int4(q4), pack_bf16(w.bfloat16())
    p_fp8 = pack_fp8(q_fp8)
    return {
        "int8": (lambda x: kernels.int8_matmul(x, *p8), dequantize_weight(q8, torch.float32)),
        "fp8": (lambda x: kernels.fp8_matmul(x, *p_fp8), dequantize_weight(q_fp8,
                                                                           torch.float32)),
        "int4": (lambda x: kernels.int4_matmul(x, *p4, 32), twin_int4(q4)),
        "bf16": (lambda x: kernels.bf16_matmul(x, pb), w.bfloat16().float()),
    }


@pytest.mark.parametrize("op", ["int8", "int4", "fp8", "bf16"])
@pytest.mark.parametrize("rows", [3, 5])  # AVX-512 int8: 24-bit planes (1-3 rows), bf16 (4+)
def test_nan_and_inf_in_a_row_stay_in_that_row(path, dtype, op, rows):
    """As the twin: a NaN makes its row NaN, an inf makes every output of its row NaN or inf
    (inf x 0 is NaN, inf - inf too: which one may differ); the other rows are untouched."""
    product, weight = _products()[op]
    x = torch.randn(rows, 64).to(dtype)
    x[0, 7], x[-1, 9] = float("nan"), float("inf")
    got, want = product(x), (x.float() @ weight.T).to(dtype)
    assert got[0].isnan().all() and want[0].isnan().all()
    assert not got[-1].isfinite().any() and not want[-1].isfinite().any()
    check(got[1:-1], x[1:-1], weight)


# -- what the kernels refuse -----------------------------------------------------------------
def test_shapes_and_dtypes_the_kernels_do_not_take_are_refused():
    torch.manual_seed(0)
    odd = quantize_int8(torch.randn(16, 24))  # 24 inputs: not a multiple of 16
    with pytest.raises(RuntimeError, match="inputs a multiple of 16"):
        kernels.int8_matmul(torch.randn(1, 24), *pack_int8(odd))
    q8 = pack_int8(quantize_int8(torch.randn(16, 64)))
    with pytest.raises(RuntimeError, match="x has 32 inputs; the weight takes 64"):
        kernels.int8_matmul(torch.randn(1, 32), *q8)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        kernels.int8_matmul(torch.randn(1, 64).half(), *q8)
    q4 = pack_int4(quantize_int4(torch.randn(16, 64), 32))
    with pytest.raises(RuntimeError, match="pack_int4"):
        kernels.int4_matmul(torch.randn(1, 64), *q4, 48)  # a group that does not divide K
    with pytest.raises(RuntimeError, match="pack_bf16"):
        kernels.bf16_matmul(torch.randn(1, 64), pack_bf16(torch.randn(16, 64)))  # float32
    with pytest.raises(RuntimeError, match="inputs a multiple of 4"):
        kernels.fp8_matmul(torch.randn(1, 6), torch.zeros(1, 6, 16, dtype=torch.uint8),
                           torch.ones(16))
    packed, scales = pack_fp8(quantize_fp8(torch.randn(16, 64)))
    with pytest.raises(RuntimeError, match="float32 scales"):
        kernels.fp8_matmul(torch.randn(1, 64), packed, scales.bfloat16())


class _Model(nn.Module):
    """What pack_linears_for_cpu reads: model.model.embed_tokens, model.lm_head, layers."""

    def __init__(self, dtype, tied=False):
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(64, 32).to(dtype)
        self.model.int8 = QuantizedLinear(quantize_int8(torch.randn(48, 32).to(dtype)), None)
        self.model.int4 = QuantizedLinear(quantize_int4(torch.randn(32, 64).to(dtype), 32),
                                          torch.randn(32).to(dtype))
        self.model.odd = QuantizedLinear(quantize_int8(torch.randn(20, 32).to(dtype)), None)
        self.model.fp8 = QuantizedLinear(quantize_fp8(torch.randn(32, 32).to(dtype)), None)
        self.model.odd_fp8 = QuantizedLinear(quantize_fp8(torch.randn(20, 32).to(dtype)), None)
        self.model.dense = nn.Linear(32, 32).to(dtype)
        self.lm_head = nn.Linear(32, 64, bias=False).to(dtype)
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight


NAMES = ("int8", "int4", "odd", "fp8", "odd_fp8", "dense")


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_pack_linears_uses_our_kernels_for_bf16_and_float32_models(dtype):
    model = _Model(dtype, tied=True)
    x = torch.randn(2, 3, 32).to(dtype)  # [batch, tokens, in]: leading dims kept
    x64 = torch.randn(5, 64).to(dtype)
    want = {name: getattr(model.model, name)(x if name != "int4" else x64)
            for name in NAMES}
    pack_linears_for_cpu(model, dtype)
    m = model.model
    assert isinstance(m.int8, PackedInt8Linear) and isinstance(m.int4, PackedInt4Linear)
    assert isinstance(m.fp8, PackedFp8Linear)
    assert type(m.odd_fp8) is QuantizedLinear  # 20 outputs: the twin (torch has no fp8 kernel)
    # 20 outputs: not packable. A bf16 model takes torch's int8 kernel, float32 the twin.
    assert isinstance(m.odd, Int8PackedLinear if dtype == torch.bfloat16 else QuantizedLinear)
    if dtype == torch.bfloat16:  # bf16 weights on our kernel; the tied head's table shared
        assert isinstance(m.dense, PackedBF16Linear) and isinstance(model.lm_head,
                                                                    PackedBF16Linear)
        assert isinstance(m.embed_tokens, PackedEmbedding)
    else:  # float32 weights stay F.linear (BLAS)
        assert type(m.dense) is nn.Linear and type(model.lm_head) is nn.Linear
        assert m.int4.scales.dtype == torch.float32  # the twin's float32 scales, as they are
    rtol = 2**-7 if dtype == torch.bfloat16 else 1e-5
    for name in NAMES:
        got = getattr(m, name)(x if name != "int4" else x64)
        assert got.shape == want[name].shape and got.dtype == dtype
        torch.testing.assert_close(got.float(), want[name].float(), rtol=rtol, atol=rtol)
