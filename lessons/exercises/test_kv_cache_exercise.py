"""Checks lesson 1's exercise: a KV cache must change the cost of generation, never its tokens.

    pytest lessons/exercises/test_kv_cache_exercise.py

Each test runs twice: against the solution (always) and against your file,
lessons/exercises/kv_cache_exercise.py (skipped until store_and_fetch stops raising
NotImplementedError). conftest.py loads both by file path, so lessons/ needs no __init__.py.
"""

import importlib

import pytest
import torch

from pagedllm.reference import generate, load_model
from pagedllm.reference.model.random_checkpoint import tiny_config, write_random_checkpoint

# The module, not the function: pagedllm.reference exports `generate`, which hides the module
# of the same name from attribute access.
generate_module = importlib.import_module("pagedllm.reference.engine.generate")

EXERCISE = "kv_cache_exercise"  # impl (conftest.py): the solution's file, then yours
PROMPT = [72, 101, 108, 108, 111, 44, 32, 75, 86]  # nine token ids, any in the vocabulary do
NEW_TOKENS = 24


@pytest.fixture
def cache_class(impl):
    cls = impl.module.MyContiguousCache
    probe = cls(1, 4, 1, 2)
    with impl.skip_if_not_attempted():
        probe.store_and_fetch(0, torch.arange(1), torch.zeros(1, 1, 2), torch.zeros(1, 1, 2))
    return cls


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "m", tiny_config("llama"),
                                   seed=0, init_std=0.2)
    return load_model(path)


def test_store_then_fetch(cache_class):
    """Prefill 3 tokens, then decode 1: the fetch returns all 4 rows, in position order."""
    cache = cache_class(2, 8, 2, 4)
    k = torch.randn(4, 2, 4)
    v = torch.randn(4, 2, 4)
    for layer in range(2):
        keys, values, key_pos = cache.store_and_fetch(layer, torch.arange(3), k[:3], v[:3])
        assert keys.shape == (3, 2, 4), ("prefill: return the 3 stored rows, not the reservation"
                                         "\n프리필: 예약 공간 전체가 아니라 저장된 행 3개를 "
                                         "돌려주세요")
        torch.testing.assert_close(keys, k[:3])
        torch.testing.assert_close(values, v[:3])
        assert key_pos.tolist() == [0, 1, 2]
    assert cache.num_cached_tokens == 3
    for layer in range(2):
        keys, values, key_pos = cache.store_and_fetch(layer, torch.tensor([3]), k[3:], v[3:])
        torch.testing.assert_close(keys, k, msg=("decode: the stored prefix plus the new row"
                                                 "\n디코드: 저장된 프리픽스에 새 행을 더한 것"))
        torch.testing.assert_close(values, v)
        assert key_pos.tolist() == [0, 1, 2, 3]
    assert cache.num_cached_tokens == 4


def test_same_tokens_as_no_cache(cache_class, model, monkeypatch):
    """24 greedy tokens with your cache equal 24 greedy tokens recomputed from scratch."""
    expected = generate(model, PROMPT, NEW_TOKENS, cache="none")

    made, fed = [], []  # the caches generate() built; tokens fed to layer 0 at each step

    def make_cache(model, kind, max_len):
        cfg = model.config
        param = next(model.parameters())
        cache = cache_class(cfg.num_layers, max_len, cfg.num_kv_heads, cfg.head_dim,
                            dtype=param.dtype, device=param.device)
        store_and_fetch = cache.store_and_fetch

        def spy(layer, positions, k, v):
            if layer == 0:
                fed.append(len(positions))
            return store_and_fetch(layer, positions, k, v)

        cache.store_and_fetch = spy
        made.append(cache)
        return cache

    monkeypatch.setattr(generate_module, "make_cache", make_cache)
    got = generate(model, PROMPT, NEW_TOKENS, cache="contiguous")

    assert len(made) == 1
    assert got == expected, ("the cache changed the generated tokens"
                             "\n캐시가 생성된 토큰을 바꿨습니다")
    # The last generated token is never fed back, so prompt + 23 tokens end up stored.
    assert made[0].num_cached_tokens == len(PROMPT) + NEW_TOKENS - 1, (
        "num_cached_tokens must count the tokens stored (generate feeds tokens[num_cached:])"
        "\nnum_cached_tokens는 저장된 토큰을 세야 합니다(generate는 tokens[num_cached:]를 "
        "넣습니다)")
    assert fed == [len(PROMPT)] + [1] * (NEW_TOKENS - 1), (
        "prefill once, then one token a step"
        "\n프리필 한 번, 그다음 스텝마다 토큰 하나")
