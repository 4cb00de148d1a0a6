"""Checks lesson 12's exercise: KV bytes per token, and decode attention by K/V-head groups.

    pytest lessons/exercises/test_gqa_exercise.py

Each test runs twice: against the solution (always) and against your file,
lessons/exercises/gqa_exercise.py (skipped while the function it needs still raises
NotImplementedError). conftest.py loads both by file path, so lessons/ needs no __init__.py.
"""

import pytest
import torch

from pagedllm.reference.kv_size import PRESETS, kv_size
from pagedllm.reference.ops.attention import causal_attention

EXERCISE = "gqa_exercise"  # impl (conftest.py): the solution's file, then yours
PROBES = {
    "kv_bytes_per_token": (1, 1, 1, 1),
    "mla_bytes_per_token": (1, 1, 1, 1),
    "grouped_decode": (torch.zeros(1, 2), torch.zeros(1, 1, 2), torch.zeros(1, 1, 2), 1.0),
    "kv_bytes_read": (1, 1, 1, 1, 1, True),
}


def use(impl, function: str):
    """The function, or a skip while the learner's version still raises NotImplementedError."""
    return impl.use(function, *PROBES[function])


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_bytes_per_token_matches_the_calculator(impl, preset, dtype):
    fn = use(impl, "kv_bytes_per_token")
    s = kv_size(preset, dtype)
    assert fn(s.num_layers, s.num_kv_heads, s.head_dim, s.dtype_bytes) == s.bytes_per_token


def test_bytes_per_token_examples(impl):
    fn = use(impl, "kv_bytes_per_token")
    assert fn(32, 32, 128, 2) == 512 * 1024, "Llama-2-7B (MHA): 512 KiB"
    assert fn(32, 8, 128, 2) == 128 * 1024, ("Llama-3-8B (GQA, 8 K/V heads): 128 KiB"
                                             "\nLlama-3-8B (GQA, K/V 헤드 8개): 128 KiB")
    assert fn(32, 1, 128, 2) == 16 * 1024, ("one K/V head (MQA): 16 KiB"
                                            "\nK/V 헤드 하나(MQA): 16 KiB")


def test_mla_deepseek_v2(impl):
    fn = use(impl, "mla_bytes_per_token")
    assert fn(60, 512, 64, 2) == 69_120, ("DeepSeek-V2: 60 layers x (512 + 64) x 2 bytes"
                                          "\nDeepSeek-V2: 레이어 60개 x (512 + 64) x 2바이트")
    assert fn(1, 512, 64, 1) == 576
    # The latent replaces K and V together: less than two K/V heads of 128 in a layer
    kv = use(impl, "kv_bytes_per_token")
    assert fn(60, 512, 64, 2) < kv(60, 3, 128, 2)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (32, 8), (6, 1), (5, 1)])
def test_grouped_decode_matches_reference(impl, heads, kv_heads, monkeypatch):
    fn = use(impl, "grouped_decode")
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    S, d = 13, 16
    q = torch.randn(heads, d, generator=gen)
    k = torch.randn(S, kv_heads, d, generator=gen)
    v = torch.randn(S, kv_heads, d, generator=gen)
    positions = torch.arange(S)
    want = causal_attention(q[None], k, v, positions[-1:], positions, d ** -0.5)[0]

    def forbidden(*args, **kwargs):
        raise AssertionError("K/V copied once per query head: use the groups instead"
                             "\nK/V를 쿼리 헤드마다 한 번씩 복사했습니다: 대신 그룹을 쓰세요")
    monkeypatch.setattr(torch, "repeat_interleave", forbidden)
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", forbidden)
    monkeypatch.setattr(torch.Tensor, "repeat", forbidden)
    got = fn(q, k, v, d ** -0.5)
    assert got.shape == (heads, d)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_grouped_heads_read_their_own_kv_head(impl):
    """Values that name their K/V head: head h must come out as h // group."""
    fn = use(impl, "grouped_decode")
    heads, kv_heads, S, d = 8, 2, 5, 4
    v = torch.arange(kv_heads, dtype=torch.float32)[None, :, None].expand(S, kv_heads, d)
    out = fn(torch.randn(heads, d), torch.randn(S, kv_heads, d), v.contiguous(), 0.5)
    want = (torch.arange(heads) // (heads // kv_heads)).float()[:, None].expand(heads, d)
    torch.testing.assert_close(out, want)


def test_read_savings(impl):
    fn = use(impl, "kv_bytes_read")
    # Llama-3-8B, one layer, a 4096-token context: 16 MiB grouped, 64 MiB per query head
    assert fn(4096, 32, 8, 128, 2, grouped=True) == 16 * 2**20
    assert fn(4096, 32, 8, 128, 2, grouped=False) == 64 * 2**20
    for heads, kv_heads in [(32, 32), (32, 8), (32, 1), (64, 8)]:
        ratio = fn(100, heads, kv_heads, 64, 2, False) / fn(100, heads, kv_heads, 64, 2, True)
        assert ratio == heads // kv_heads, ("grouping divides the reads by the group size"
                                            "\n그룹으로 묶으면 읽는 양이 그룹 크기분의 1로 "
                                            "줄어듭니다")
