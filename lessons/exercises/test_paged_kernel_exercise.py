"""Checks lesson 10's exercise: decode attention read through the block table, in place.

    pytest lessons/exercises/test_paged_kernel_exercise.py

Each test runs twice: against the solution (always) and against your file,
lessons/exercises/paged_kernel_exercise.py (skipped while the function still raises
NotImplementedError). conftest.py loads both by file path, so lessons/ needs no __init__.py.

The reference is decode_attention (reference/ops/attention.py). The pool's blocks are handed out
in a shuffled order and every slot no sequence wrote is NaN, so reading one slot too many, or
the wrong block, turns the output into NaN and the comparison fails.
"""

import random

import pytest
import torch

from pagedllm.reference.ops.attention import decode_attention

EXERCISE = "paged_kernel_exercise"  # impl (conftest.py): the solution's file, then yours


@pytest.fixture
def attend(impl):
    return impl.use("attend_in_place", torch.zeros(1, 2), torch.zeros(1, 1, 1, 2),
                    torch.zeros(1, 1, 1, 2), [0], 1, 1.0)


def poisoned_pool(seed, seq_lens, block_size, kv_heads, head_dim, spare=3):
    """A NaN pool and shuffled block tables holding random K/V for each sequence."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + spare
    order = list(range(num_blocks))
    rng.shuffle(order)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    tables = []
    for n, blocks in zip(seq_lens, need, strict=True):
        table = [order.pop() for _ in range(blocks)]
        for p in range(n):
            b, s = table[p // block_size], p % block_size
            k_cache[b, s] = torch.randn(kv_heads, head_dim, generator=gen)
            v_cache[b, s] = torch.randn(kv_heads, head_dim, generator=gen)
        tables.append(table)
    return k_cache, v_cache, tables


def reference(q, k_cache, v_cache, table, seq_len, scale):
    tables = torch.tensor([table], dtype=torch.int32)
    return decode_attention(q[None], k_cache, v_cache, tables, torch.tensor([seq_len]),
                            scale)[0]


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (6, 1)])
def test_matches_reference(attend, block_size, heads, kv_heads):
    head_dim = 8
    seq_lens = [1, block_size, block_size + 1, 3 * block_size - 1, 37]
    k_cache, v_cache, tables = poisoned_pool(block_size * 10 + heads, seq_lens, block_size,
                                             kv_heads, head_dim)
    gen = torch.Generator().manual_seed(heads)
    for n, table in zip(seq_lens, tables, strict=True):
        q = torch.randn(heads, head_dim, generator=gen)
        got = attend(q, k_cache, v_cache, table, n, head_dim ** -0.5)
        want = reference(q, k_cache, v_cache, table, n, head_dim ** -0.5)
        assert got.shape == (heads, head_dim)
        assert not torch.isnan(got).any(), (f"seq_len {n}: a NaN slot was read"
                                            f"\nseq_len {n}: NaN 슬롯을 읽었습니다")
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5,
                                   msg=(f"seq_len {n}, block table {table}"
                                        f"\nseq_len {n}, 블록 테이블 {table}"))


def test_one_token_is_its_value(attend):
    """With one key, softmax gives it probability 1: the output is that value exactly."""
    k_cache, v_cache, tables = poisoned_pool(0, [1], 4, 2, 8)
    out = attend(torch.randn(4, 8), k_cache, v_cache, tables[0], 1, 0.3)
    block = tables[0][0]
    torch.testing.assert_close(out, v_cache[block, 0].repeat_interleave(2, dim=0))


def test_padding_entries_are_never_read(attend):
    """A block table longer than the sequence needs (padding entries pointing anywhere)."""
    k_cache, v_cache, tables = poisoned_pool(5, [9], 4, 1, 8, spare=2)
    nan_block = next(b for b in range(k_cache.shape[0]) if b not in tables[0])
    table = tables[0] + [nan_block, nan_block]
    q = torch.randn(2, 8)
    got = attend(q, k_cache, v_cache, table, 9, 0.5)
    torch.testing.assert_close(got, reference(q, k_cache, v_cache, tables[0], 9, 0.5))
