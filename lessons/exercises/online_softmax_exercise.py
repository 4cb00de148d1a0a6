"""Exercise (lesson 11, "FlashAttention and the online softmax"): attention one tile at a time.

Attention of some query rows over n keys is softmax(scores) @ values, with scores [rows, n] and
values [n, d]. A kernel never holds all n scores of a row: it meets the keys one tile at a time,
and flash-decoding even hands different tiles to different programs. Each tile leaves a
*partial result* (m, l, acc) per row:

- m   [rows]     the largest score of the tile (-inf if every score of the row is -inf, i.e.
                 masked);
- l   [rows]     the sum of exp(score - m) over the tile's keys;
- acc [rows, d]  the sum of exp(score - m) * value over the same keys.

Write the three functions below. Check your work with

    pytest lessons/exercises/test_online_softmax_exercise.py

The test splits random attention problems into tiles of random sizes, merges the partials in
random orders and compares the result with torch.softmax(scores) @ values. Until you edit this
file the test reports your version as skipped and checks only the solution.
"""

import torch

Partial = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (m [rows], l [rows], acc [rows, d])


def partial(scores: torch.Tensor, values: torch.Tensor) -> Partial:
    """One tile: scores [rows, n] (may contain -inf), values [n, d] -> (m, l, acc).

    A row whose scores are all -inf has m = -inf, l = 0, acc = 0, and no NaN anywhere.
    """
    # exp(-inf - (-inf)) is NaN: think about what to subtract when the row's max is -inf.
    raise NotImplementedError("exercise: implement partial")


def merge(a: Partial, b: Partial) -> Partial:
    """The partial result of the union of two disjoint sets of keys, from theirs alone.

    Must not overflow for scores in the thousands, and must accept partials of rows that saw no
    key at all (m = -inf, l = 0).
    """
    # Each partial was summed against its own max. Against the new max M = max(m_a, m_b),
    # which factor corrects each one's l and acc?
    raise NotImplementedError("exercise: implement merge")


def finish(p: Partial) -> torch.Tensor:
    """The attention output [rows, d] of a partial covering all the keys: acc / l.

    A row that saw no visible key (l = 0) comes out as zeros.
    """
    raise NotImplementedError("exercise: implement finish")
