"""How much a KV cache saves on one decode step, on the CPU.

A decode step at context length L either runs one new token against L cached keys (with a
cache) or reruns all L tokens (without). Both are timed by pytest-benchmark on the shipped tiny
model (4 layers, GQA, 3.9M parameters, float32); the cached test also times the uncached step
side by side and records the ratio in the benchmark's extra_info ("speedup").

    pytest benchmarks/test_decode_cpu.py --benchmark-json decode.json
"""

import time

import pytest
import torch

from pagedllm.reference import ContiguousCache, NoCache, load_model
from pagedllm.serving.default_model import default_model_dir

CONTEXT = 256  # tokens already in the sequence when the step runs


@pytest.fixture(scope="module")
def model():
    return load_model(default_model_dir())


def uncached_step(model, ids):
    return model(ids, torch.arange(len(ids)), NoCache(), logits_indices=torch.tensor([-1]))


def cached_step(model, ids, cache):
    # Position CONTEXT-1 is rewritten each round with the same K/V: the same work as a new token.
    return model(ids[-1:], torch.arange(len(ids) - 1, len(ids)), cache,
                 logits_indices=torch.tensor([-1]))


def prefilled_cache(model, ids):
    cfg = model.config
    cache = ContiguousCache(cfg.num_layers, len(ids), cfg.num_kv_heads, cfg.head_dim)
    model(ids[:-1], torch.arange(len(ids) - 1), cache)
    return cache


def min_time(fn, repeats: int = 15) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@torch.inference_mode()
def test_decode_step_without_cache(benchmark, model):
    ids = torch.randint(0, model.config.vocab_size, (CONTEXT,))
    benchmark.extra_info["context"] = CONTEXT
    benchmark(uncached_step, model, ids)


@torch.inference_mode()
def test_decode_step_with_cache(benchmark, model):
    ids = torch.randint(0, model.config.vocab_size, (CONTEXT,))
    cache = prefilled_cache(model, ids)
    # Same next-token logits both ways, or the timing compares different work.
    torch.testing.assert_close(cached_step(model, ids, cache), uncached_step(model, ids),
                               atol=1e-4, rtol=0)
    benchmark(cached_step, model, ids, cache)
    uncached = min_time(lambda: uncached_step(model, ids))
    cached = min_time(lambda: cached_step(model, ids, cache))
    speedup = uncached / cached
    benchmark.extra_info.update(context=CONTEXT, uncached_step_s=uncached, cached_step_s=cached,
                                speedup=round(speedup, 2))
    print(f"\ndecode step at context {CONTEXT}: cached {cached * 1e3:.2f} ms, "
          f"uncached {uncached * 1e3:.2f} ms, speed-up {speedup:.1f}x")
    # The cached step does ~1/CONTEXT of the matrix work; even with Python overhead it must win.
    assert speedup > 1.5
