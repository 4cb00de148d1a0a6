"""The torch twins of the small kernels, timed on the CPU: the baseline the kernels replace.

Shapes are SmolLM2-135M's (hidden 576, 9 query heads and 3 KV heads of 64, intermediate 1536,
30 layers), for a decode batch (64 tokens) and a prefill (2048 tokens); one torch thread, so
that numbers from different machines and runs compare. Each benchmark records its tensors'
minimum memory traffic ("bytes") in extra_info: bytes / time is the bandwidth the op reaches.

    pytest benchmarks/test_ops_cpu.py --benchmark-json ops.json

The timing budget per benchmark is small (``max_time`` below) so that the normal test run,
which collects this folder, stays fast; raise it with care when comparing machines.
"""

import pytest
import torch

from pagedllm.reference.ops import copy_blocks, rms_norm, rotary, silu_and_mul, store_kv

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, LAYERS = 576, 9, 3, 64, 1536, 30
BLOCK_SIZE = 16
TOKENS = [64, 2048]  # a decode batch, a prefill

pytestmark = pytest.mark.benchmark(group="ops-cpu", max_time=0.1, min_rounds=5)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("tokens", TOKENS)
@torch.inference_mode()
def test_rms_norm_with_residual(benchmark, gen, tokens):
    x = torch.randn(tokens, HIDDEN, generator=gen)
    residual = torch.randn(tokens, HIDDEN, generator=gen)
    weight = torch.randn(HIDDEN, generator=gen)
    benchmark.extra_info.update(tokens=tokens, bytes=nbytes(x, residual, x, x))  # 2 in, 2 out
    benchmark(rms_norm, x, weight, 1e-5, residual)


@pytest.mark.parametrize("tokens", TOKENS)
@torch.inference_mode()
def test_rotary(benchmark, gen, tokens):
    q = torch.randn(tokens, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen)
    positions = torch.randint(0, 8192, (tokens,), generator=gen)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    benchmark.extra_info.update(tokens=tokens, bytes=2 * nbytes(q, k))  # read and write q, k
    benchmark(rotary, q, k, positions, inv_freq)


@pytest.mark.parametrize("tokens", TOKENS)
@torch.inference_mode()
def test_silu_and_mul(benchmark, gen, tokens):
    x = torch.randn(tokens, 2 * INTERMEDIATE, generator=gen)
    benchmark.extra_info.update(tokens=tokens, bytes=nbytes(x) * 3 // 2)  # [gate|up] in, d out
    benchmark(silu_and_mul, x)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("padding", [False, True], ids=["no_padding", "padding"])
@torch.inference_mode()
def test_store_kv(benchmark, gen, tokens, padding):
    num_blocks = 2 * tokens // BLOCK_SIZE
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:tokens]
    if padding:  # one row in eight is padding (-1): the twin's filtering path
        slots[::8] = -1
    cache_shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.zeros(cache_shape), torch.zeros(cache_shape)
    benchmark.extra_info.update(tokens=tokens, bytes=2 * nbytes(k, v))  # read rows, write slots
    benchmark(store_kv, k, v, k_cache, v_cache, slots)


@pytest.mark.parametrize("pairs", [4, 64])
@torch.inference_mode()
def test_copy_blocks(benchmark, gen, pairs):
    num_blocks = 256
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_caches = [torch.zeros(shape) for _ in range(LAYERS)]
    v_caches = [torch.zeros(shape) for _ in range(LAYERS)]
    order = torch.randperm(num_blocks, generator=gen)
    mapping = torch.stack([order[:pairs], order[pairs:2 * pairs]], dim=1)  # [pairs, 2]
    block_bytes = nbytes(k_caches[0][0])
    benchmark.extra_info.update(pairs=pairs, layers=LAYERS,
                                bytes=2 * pairs * 2 * LAYERS * block_bytes)  # read + write
    benchmark(copy_blocks, k_caches, v_caches, mapping)
