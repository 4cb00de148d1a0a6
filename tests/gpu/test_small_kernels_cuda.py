"""The small Triton kernels (store_kv, copy_blocks, rms_norm, rotary, silu_and_mul), compiled
for the GPU, against their torch twins run on the same CUDA tensors, at realistic shapes.

Tolerances, kernel against twin in the same dtype:

- store_kv, copy_blocks: exact (NaN == NaN). They only move bits.
- float32: max abs error < 1e-4 on values of order 1-10. Same float32 arithmetic in another
  order (reduction tree, libdevice's rsqrt/sin/cos/exp against torch's): a few ulps, ~1e-6.
- bf16 and fp16: max abs error <= 4 ulps of the largest expected value. The kernels compute in
  float32 and round once (to nearest even, like torch); the twins round intermediates to the
  model dtype (cos/sin, each product, silu before the multiply): up to ~3 ulps apart.
- rms_norm's new residual: exact in every dtype. Both sides add in float32 and round once.
"""

import zlib

import pytest
import torch

from pagedllm.kernels import copy_blocks as copy_blocks_module
from pagedllm.kernels.copy_blocks import copy_blocks
from pagedllm.kernels.rms_norm import rms_norm
from pagedllm.kernels.rotary import rotary
from pagedllm.kernels.silu_and_mul import silu_and_mul
from pagedllm.kernels.store_kv import store_kv
from pagedllm.reference.ops import copy_blocks as copy_blocks_reference
from pagedllm.reference.ops import rms_norm as rms_norm_reference
from pagedllm.reference.ops import rotary as rotary_reference
from pagedllm.reference.ops import silu_and_mul as silu_and_mul_reference
from pagedllm.reference.ops import store_kv as store_kv_reference

from ..kernels.test_small_ops import assert_matches  # the same tolerances as on the CPU

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NAN = float("nan")


@pytest.fixture(autouse=True)
def _compiled(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # CUDA tensors: the compiled kernel


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator seeded by the test's id: fresh inputs per parametrization, reproducible."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def randn(gen, *shape, dtype=torch.float32, scale=1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(device="cuda", dtype=dtype)


def same(actual, expected):
    torch.testing.assert_close(actual, expected, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size,kv_heads,head_dim", [(16, 8, 128), (32, 1, 80), (8, 4, 96)])
def test_store_kv(gen, dtype, block_size, kv_heads, head_dim):
    num_blocks, num_tokens = 64, 300
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[:40]] = -1  # padding rows
    slots = slots.cuda()
    fused = randn(gen, num_tokens, 3, kv_heads, head_dim, dtype=dtype)  # q | k | v
    k, v = fused[:, 1], fused[:, 2]  # strided views, as out of a fused projection
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, NAN, dtype=dtype, device="cuda")
    v_cache = torch.full(shape, NAN, dtype=dtype, device="cuda")
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    store_kv_reference(k, v, k_expected, v_expected, slots)
    store_kv(k, v, k_cache, v_cache, slots)
    same(k_cache, k_expected)
    same(v_cache, v_expected)


def copy_blocks_case(gen, dtype, num_layers=4, num_blocks=64, num_pairs=10,
                     shape=(16, 8, 128)):
    order = torch.randperm(num_blocks, generator=gen)
    used, free = order[: num_blocks // 2], order[num_blocks // 2:]
    src = used[torch.randint(len(used), (num_pairs,), generator=gen)]
    mapping = torch.stack([src, free[:num_pairs]], dim=1).cuda()  # [N, 2]

    def cache():
        c = torch.full((num_blocks, *shape), NAN, device="cuda")
        c[used.cuda()] = randn(gen, len(used), *shape)
        return c.to(dtype)

    return ([cache() for _ in range(num_layers)], [cache() for _ in range(num_layers)],
            mapping)


def check_copy_blocks(k_caches, v_caches, mapping):
    k_expected = [c.clone() for c in k_caches]
    v_expected = [c.clone() for c in v_caches]
    copy_blocks_reference(k_expected, v_expected, mapping)
    copy_blocks(k_caches, v_caches, mapping)
    for actual, expected in zip((*k_caches, *v_caches), (*k_expected, *v_expected),
                                strict=True):
        same(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_blocks(gen, dtype):
    check_copy_blocks(*copy_blocks_case(gen, dtype))


def test_copy_blocks_views_of_one_stacked_tensor(gen):
    k_caches, v_caches, mapping = copy_blocks_case(gen, torch.bfloat16, shape=(32, 1, 80))
    stacked = torch.stack([torch.stack(k_caches), torch.stack(v_caches)])
    check_copy_blocks(list(stacked[0]), list(stacked[1]), mapping)


def test_copy_blocks_interpreted_on_cuda_tensors(gen, monkeypatch):
    """Under the interpreter CUDA tensors take one launch per cache (a device address in the
    table could not be read on the host); the result is the same."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not copy_blocks_module._one_launch_possible([torch.empty(1, device="cuda")])
    check_copy_blocks(*copy_blocks_case(gen, torch.float16, num_layers=1, num_blocks=6,
                                        num_pairs=2, shape=(8, 2, 64)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [576, 4096])
def test_rms_norm(gen, dtype, hidden):
    x = randn(gen, 257, hidden, dtype=dtype, scale=3.0)
    residual = randn(gen, 257, hidden, dtype=dtype)
    weight = (1 + randn(gen, hidden, scale=0.1)).to(dtype)
    for r in (residual, None):
        expected, expected_residual = rms_norm_reference(x, weight, 1e-6, r)
        normed, new_residual = rms_norm(x, weight, 1e-6, r)
        assert_matches(normed, expected)
        same(new_residual, expected_residual)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (32, 32, 128), (14, 2, 64),
                                                      (40, 8, 80), (16, 1, 96)])
def test_rotary(gen, dtype, heads, kv_heads, head_dim):
    num_tokens = 257
    q_width, k_width = heads * head_dim, kv_heads * head_dim
    fused = randn(gen, num_tokens, q_width + 2 * k_width, dtype=dtype)
    fused[:, q_width + k_width:] = NAN  # V: must stay untouched
    q = fused[:, :q_width].view(num_tokens, heads, head_dim)
    k = fused[:, q_width:q_width + k_width].view(num_tokens, kv_heads, head_dim)
    positions = torch.randint(0, 32768, (num_tokens,), generator=gen).cuda()
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    expected_q, expected_k = rotary_reference(q.clone(), k.clone(), positions, inv_freq.cuda())
    out_q, out_k = rotary(q, k, positions, inv_freq.cuda())
    assert out_q is q and out_k is k
    assert_matches(q, expected_q)
    assert_matches(k, expected_k)
    assert fused[:, q_width + k_width:].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [1536, 11008])
def test_silu_and_mul(gen, dtype, d):
    x = randn(gen, 257, 2 * d, dtype=dtype, scale=3.0)
    assert_matches(silu_and_mul(x), silu_and_mul_reference(x))
