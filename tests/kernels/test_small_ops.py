"""rms_norm, rotary and silu_and_mul kernels against their torch twins, on the CPU through
Triton's interpreter.

Outputs the launchers allocate start as NaN (``torch.empty`` is patched to poison float
tensors), so an element a kernel forgets to write fails the comparison. rotary works in place,
so q and k are views into a fused QKV buffer whose V part is NaN: a write outside q's and k's
rows would spoil V, a read outside them would bring NaN in, and with frequencies that turn
every pair by a sizeable angle an element left unrotated differs from the twin's.

Tolerances (``assert_matches``), kernel against twin in the same dtype:

- float32: max abs error < 1e-4 on values of order 1-10. Both sides do the same float32
  arithmetic in a different order (reduction tree, numpy's vs torch's sin/cos), which moves
  results by a few ulps (~1e-6); any real mistake is off by O(1).
- bf16 and fp16: max abs error <= 4 ulps of the largest expected value. The kernels compute
  in float32 and round once; the twins round intermediates to the model dtype (cos/sin, each
  product, silu before the multiply), and Triton 3.9's interpreter truncates float32 -> bf16
  instead of rounding to nearest: together up to ~2-3 ulps, and far below an O(1) mistake.

The interpreter runs one program at a time in numpy (tens of milliseconds each): small shapes.
"""

import zlib

import pytest
import torch

from pagedllm.kernels import rms_norm as rms_norm_module
from pagedllm.kernels import rotary as rotary_module
from pagedllm.kernels import silu_and_mul as silu_and_mul_module
from pagedllm.kernels.rms_norm import rms_norm
from pagedllm.kernels.rotary import rotary
from pagedllm.kernels.silu_and_mul import silu_and_mul
from pagedllm.reference.ops import rms_norm as rms_norm_reference
from pagedllm.reference.ops import rotary as rotary_reference
from pagedllm.reference.ops import silu_and_mul as silu_and_mul_reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FP32_ATOL = 1e-4  # see the module docstring
LOW_PRECISION_ULPS = 4


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    """TRITON_INTERPRET=1: kernel_runner reads it at every launch."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _poisoned_outputs(monkeypatch):
    """torch.empty returns NaN-filled float tensors, so unwritten output elements show."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator seeded by the test's id: fresh inputs per parametrization, reproducible."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def randn(gen, *shape, dtype=torch.float32, scale=1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


def assert_matches(actual: torch.Tensor, expected: torch.Tensor,
                   precision: torch.dtype | None = None) -> None:
    """Within the tolerance of `precision`: the dtype the values were rounded to on the way
    (the output's, unless a float32 output was computed from bf16-rounded values)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert not actual.isnan().any(), "NaN in the output: an element was not written"
    error = (actual.float() - expected.float()).abs().max().item()
    precision = precision or expected.dtype
    if precision == torch.float32:
        assert error < FP32_ATOL, error
    else:
        ulp = torch.finfo(precision).eps * expected.float().abs().max().item()
        assert error <= LOW_PRECISION_ULPS * ulp, (error, ulp)


class Boom:
    """Stands in for a kernel that must not run: any launch fails the test."""

    def __getitem__(self, grid):
        raise AssertionError("the kernel ran")

    def __call__(self, *args, **kwargs):
        raise AssertionError("the kernel ran")


# ----------------------------------------------------------------------------------------------
# rms_norm

NUM_ROWS = 6


def check_rms_norm(x, weight, residual, eps=1e-5):
    x_before = x.clone()
    r_before = None if residual is None else residual.clone()
    expected, expected_residual = rms_norm_reference(x, weight, eps, residual)
    normed, new_residual = rms_norm(x, weight, eps, residual)
    assert_matches(normed, expected, precision=x.dtype)  # normed is rounded to x's dtype
    assert_matches(new_residual, expected_residual)
    torch.testing.assert_close(x, x_before, atol=0, rtol=0)  # inputs are not modified
    if residual is None:
        assert new_residual is x  # as in the twin: the first layer's input is the residual
    else:
        torch.testing.assert_close(residual, r_before, atol=0, rtol=0)


@pytest.mark.parametrize("hidden", [64, 96, 576])  # 96 and 576: not powers of two, masked
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "no_residual"])
def test_rms_norm_matches_twin(gen, hidden, with_residual):
    x = randn(gen, NUM_ROWS, hidden, scale=3.0)
    residual = randn(gen, NUM_ROWS, hidden) if with_residual else None
    check_rms_norm(x, 1 + randn(gen, hidden, scale=0.1), residual)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "no_residual"])
def test_rms_norm_dtypes(gen, dtype, with_residual):
    x = randn(gen, NUM_ROWS, 80, dtype=dtype, scale=3.0)
    residual = randn(gen, NUM_ROWS, 80, dtype=dtype) if with_residual else None
    check_rms_norm(x, (1 + randn(gen, 80, scale=0.1)).to(dtype), residual)


def test_rms_norm_float32_weight_on_bf16_promotes_like_the_twin(gen):
    x = randn(gen, NUM_ROWS, 64, dtype=torch.bfloat16)
    residual = randn(gen, NUM_ROWS, 64, dtype=torch.bfloat16)
    check_rms_norm(x, 1 + randn(gen, 64, scale=0.1), residual)  # normed comes out float32


def test_rms_norm_strided_rows_and_3d(gen):
    wide = randn(gen, NUM_ROWS, 2 * 64)
    check_rms_norm(wide[:, :64], randn(gen, 64), randn(gen, NUM_ROWS, 64))  # row stride 128
    check_rms_norm(randn(gen, 2, 3, 64), randn(gen, 64), randn(gen, 2, 3, 64))


def test_rms_norm_falls_back_to_twin_without_interpreter(gen, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(rms_norm_module, "_rms_norm_kernel", Boom())
    check_rms_norm(randn(gen, NUM_ROWS, 64), randn(gen, 64), randn(gen, NUM_ROWS, 64))


# ----------------------------------------------------------------------------------------------
# rotary

NUM_TOKENS = 5


def llama_inv_freq(head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)


def fused_qk(gen, num_heads, num_kv_heads, head_dim, dtype=torch.float32):
    """q and k as views into one [T, (heads + 2 * kv_heads) * head_dim] QKV buffer whose V part
    is NaN. Returns (q, k, fused)."""
    q_width, k_width = num_heads * head_dim, num_kv_heads * head_dim
    fused = randn(gen, NUM_TOKENS, q_width + 2 * k_width, dtype=dtype)
    fused[:, q_width + k_width:] = float("nan")
    q = fused[:, :q_width].view(NUM_TOKENS, num_heads, head_dim)  # row stride: fused width
    k = fused[:, q_width:q_width + k_width].view(NUM_TOKENS, num_kv_heads, head_dim)
    return q, k, fused


def check_rotary(q, k, fused, positions, inv_freq):
    expected_q, expected_k = rotary_reference(q.clone(), k.clone(), positions, inv_freq)
    v_before = fused[:, q[0].numel() + k[0].numel():].clone()
    out_q, out_k = rotary(q, k, positions, inv_freq)
    assert out_q is q and out_k is k  # rotated in place, returned as themselves
    assert_matches(q, expected_q)
    assert_matches(k, expected_k)
    torch.testing.assert_close(fused[:, q[0].numel() + k[0].numel():], v_before, atol=0, rtol=0,
                               equal_nan=True)  # V (NaN) untouched


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (16, 2), (8, 1)],
                         ids=["mha", "gqa4", "gqa8", "mqa"])
def test_rotary_matches_twin(gen, head_dim, heads):
    q, k, fused = fused_qk(gen, *heads, head_dim)
    positions = torch.randint(1, 4096, (NUM_TOKENS,), generator=gen)
    # Frequencies that turn every pair by a sizeable angle (as scaled ropes may): a feature
    # the kernel forgets to rotate then differs clearly from the twin's.
    inv_freq = 0.5 + torch.rand(head_dim // 2, generator=gen)
    check_rotary(q, k, fused, positions, inv_freq)


def test_rotary_several_head_tiles(gen):
    """40 heads of 128: q takes three tiles of 16 heads (the last half masked), k one."""
    q, k, fused = fused_qk(gen, 40, 8, 128)
    positions = torch.randint(1, 4096, (NUM_TOKENS,), generator=gen)
    check_rotary(q, k, fused, positions, 0.5 + torch.rand(64, generator=gen))


def test_rotary_llama_frequencies_long_positions(gen):
    q, k, fused = fused_qk(gen, 8, 2, 128)
    positions = torch.tensor([0, 1, 4095, 8191, 100_000])  # 0: the identity rotation
    check_rotary(q, k, fused, positions, llama_inv_freq(128, theta=500_000.0))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_dtypes(gen, dtype):
    q, k, fused = fused_qk(gen, 8, 2, 80, dtype=dtype)
    positions = torch.randint(0, 2048, (NUM_TOKENS,), generator=gen, dtype=torch.int32)
    check_rotary(q, k, fused, positions, llama_inv_freq(80))


def test_rotary_contiguous_inputs(gen):
    q, k = randn(gen, NUM_TOKENS, 4, 64), randn(gen, NUM_TOKENS, 2, 64)
    positions = torch.arange(NUM_TOKENS) * 7
    expected = rotary_reference(q, k, positions, llama_inv_freq(64))
    out = rotary(q, k, positions, llama_inv_freq(64))
    for actual, wanted in zip(out, expected, strict=True):
        assert_matches(actual, wanted)


def test_rotary_falls_back_to_twin_without_interpreter(gen, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(rotary_module, "_rotary_kernel", Boom())
    q, k = randn(gen, NUM_TOKENS, 4, 64), randn(gen, NUM_TOKENS, 2, 64)
    positions = torch.arange(NUM_TOKENS)
    expected = rotary_reference(q, k, positions, llama_inv_freq(64))
    for actual, wanted in zip(rotary(q, k, positions, llama_inv_freq(64)), expected,
                              strict=True):
        torch.testing.assert_close(actual, wanted, atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------
# silu_and_mul


@pytest.mark.parametrize("d", [64, 80, 1500])  # 1500: two column tiles, the second masked
@pytest.mark.parametrize("lead", [(7,), (2, 3)], ids=["2d", "3d"])
def test_silu_and_mul_matches_twin(gen, d, lead):
    x = randn(gen, *lead, 2 * d, scale=3.0)
    assert_matches(silu_and_mul(x), silu_and_mul_reference(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_dtypes(gen, dtype):
    x = randn(gen, 7, 2 * 96, dtype=dtype, scale=3.0)
    x[0, :96] = torch.linspace(-30, 30, 96)  # gates far out: exp(-g) overflows fp16 at -11
    assert_matches(silu_and_mul(x), silu_and_mul_reference(x))


def test_silu_and_mul_strided_rows(gen):
    x = randn(gen, 7, 3 * 64)[:, :128]  # row stride 192
    assert_matches(silu_and_mul(x), silu_and_mul_reference(x))


def test_silu_and_mul_falls_back_to_twin_without_interpreter(gen, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(silu_and_mul_module, "_silu_and_mul_kernel", Boom())
    x = randn(gen, 7, 2 * 64)
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_reference(x), atol=0, rtol=0)


def test_empty_inputs(gen):
    x = randn(gen, 0, 128)
    assert silu_and_mul(x).shape == (0, 64)
    normed, residual = rms_norm(x, randn(gen, 128), 1e-5, randn(gen, 0, 128))
    assert normed.shape == residual.shape == (0, 128)
    q, k = randn(gen, 0, 4, 64), randn(gen, 0, 2, 64)
    out_q, out_k = rotary(q, k, torch.zeros(0, dtype=torch.long), llama_inv_freq(64))
    assert out_q is q and out_k is k
