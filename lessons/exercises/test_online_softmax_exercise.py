"""Checks lesson 11's exercise: the online softmax's partial results and their merge.

    pytest lessons/exercises/test_online_softmax_exercise.py

Each test runs twice: against the solution (always) and against your file,
lessons/exercises/online_softmax_exercise.py (skipped while a function still raises
NotImplementedError). conftest.py loads both by file path, so lessons/ needs no __init__.py.

The reference is torch.softmax(scores) @ values in float64. Problems are cut into tiles of
random sizes (as a kernel's tiles, or flash-decoding's splits) and merged in random orders.
"""

import random

import pytest
import torch

EXERCISE = "online_softmax_exercise"  # impl (conftest.py): the solution's file, then yours


@pytest.fixture
def impl(impl):
    """Here the module itself, once no function raises NotImplementedError."""
    module = impl.module
    s, v = torch.zeros(1, 1, dtype=torch.float64), torch.zeros(1, 1, dtype=torch.float64)
    with impl.skip_if_not_attempted():
        module.finish(module.merge(module.partial(s, v), module.partial(s, v)))
    return module


def reference(scores, values):
    visible = (scores > float("-inf")).any(dim=1)
    out = torch.softmax(scores, dim=1) @ values
    return torch.where(visible[:, None], out, torch.zeros_like(out))  # rows with no key: 0


def tiles(n, rng):
    """Random cut points: tiles of 1 to n keys."""
    cuts = sorted(rng.sample(range(1, n), k=rng.randint(0, min(6, n - 1)))) if n > 1 else []
    bounds = [0, *cuts, n]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def tiled(impl, scores, values, rng, order="random"):
    parts = [impl.partial(scores[:, a:b], values[a:b]) for a, b in tiles(scores.shape[1], rng)]
    if order == "random":
        rng.shuffle(parts)
    result = parts[0]
    for p in parts[1:]:
        result = impl.merge(result, p)
    return impl.finish(result)


@pytest.mark.parametrize("seed", range(8))
def test_tiles_merged_in_any_order(impl, seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    rows, n, d = rng.randint(1, 5), rng.randint(1, 40), rng.randint(1, 9)
    scores = torch.randn(rows, n, generator=gen, dtype=torch.float64) * 3
    values = torch.randn(n, d, generator=gen, dtype=torch.float64)
    want = reference(scores, values)
    torch.testing.assert_close(tiled(impl, scores, values, rng, "in order"), want)
    torch.testing.assert_close(tiled(impl, scores, values, rng), want)


def test_one_tile_is_the_softmax(impl):
    scores = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float64)
    values = torch.eye(3, dtype=torch.float64)
    torch.testing.assert_close(impl.finish(impl.partial(scores, values)),
                               torch.softmax(scores, dim=1))


def test_large_scores_do_not_overflow(impl):
    """exp(1000) overflows even float64; a running max keeps every exponent <= 0."""
    scores = torch.tensor([[1000.0, 1001.0, 999.0, 1002.0]], dtype=torch.float64)
    values = torch.randn(4, 3, dtype=torch.float64)
    for a, b in [(0, 1), (1, 3), (3, 4)]:
        assert torch.isfinite(torch.stack(
            [x.flatten()[0] for x in impl.partial(scores[:, a:b], values[a:b])])).all()
    got = tiled(impl, scores, values, random.Random(0))
    torch.testing.assert_close(got, reference(scores, values))
    big = impl.merge(impl.partial(scores[:, :2], values[:2]),
                     impl.partial(scores[:, 2:] + 5000, values[2:]))
    assert torch.isfinite(big[1]).all() and torch.isfinite(big[2]).all()


def test_masked_tiles_change_nothing(impl):
    """A tile whose keys are all masked (-inf), as causal masking or an empty split gives."""
    gen = torch.Generator().manual_seed(1)
    scores = torch.randn(3, 10, generator=gen, dtype=torch.float64)
    values = torch.randn(10, 4, generator=gen, dtype=torch.float64)
    scores[:, 4:7] = float("-inf")
    scores[2, :5] = float("-inf")
    empty = impl.partial(scores[:, 4:7], values[4:7])
    assert (empty[0] == float("-inf")).all()
    assert not torch.isnan(empty[1]).any() and not torch.isnan(empty[2]).any()
    for order in ("in order", "random"):
        got = tiled(impl, scores, values, random.Random(3), order)
        assert not torch.isnan(got).any()
        torch.testing.assert_close(got, reference(scores, values))
    both = impl.merge(empty, impl.partial(scores[:, :4], values[:4]))  # empty first
    torch.testing.assert_close(impl.finish(both), reference(scores[:, :4], values[:4]))


def test_a_row_with_no_visible_key_is_zero(impl):
    scores = torch.full((2, 5), float("-inf"), dtype=torch.float64)
    scores[0, 2] = 0.5
    values = torch.randn(5, 3, dtype=torch.float64)
    got = tiled(impl, scores, values, random.Random(4))
    torch.testing.assert_close(got[0], values[2])
    torch.testing.assert_close(got[1], torch.zeros(3, dtype=torch.float64))


def test_merge_is_symmetric(impl):
    gen = torch.Generator().manual_seed(2)
    s = torch.randn(4, 12, generator=gen, dtype=torch.float64) * 4
    v = torch.randn(12, 5, generator=gen, dtype=torch.float64)
    a, b = impl.partial(s[:, :5], v[:5]), impl.partial(s[:, 5:], v[5:])
    for x, y in zip(impl.merge(a, b), impl.merge(b, a), strict=True):
        torch.testing.assert_close(x, y)
