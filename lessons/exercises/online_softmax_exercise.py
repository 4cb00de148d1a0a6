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

한국어:
연습 문제(11강, "FlashAttention과 온라인 소프트맥스"): 타일 하나씩 계산하는 어텐션.

쿼리 행 몇 개가 키 n개에 하는 어텐션은 softmax(scores) @ values이며, scores는 [rows, n], values는
[n, d]입니다. 커널은 한 행의 점수 n개를 한꺼번에 가지는 일이 없습니다: 키를 타일 하나씩 만나며,
flash-decoding은 아예 서로 다른 타일을 서로 다른 프로그램에 맡깁니다. 타일마다 행별로 *부분 결과*
(m, l, acc)를 남깁니다:

- m   [rows]     타일에서 가장 큰 점수(그 행의 점수가 모두 -inf, 즉 마스킹되었으면 -inf);
- l   [rows]     타일의 키들에 대한 exp(score - m)의 합;
- acc [rows, d]  같은 키들에 대한 exp(score - m) * value의 합.

아래 세 함수를 작성하세요. 다음 명령으로 확인하세요:

    pytest lessons/exercises/test_online_softmax_exercise.py

테스트는 무작위 어텐션 문제를 무작위 크기의 타일로 나누고, 부분 결과들을 무작위 순서로 합친 뒤, 그
결과를 torch.softmax(scores) @ values와 비교합니다. 이 파일을 고치기 전까지 테스트는 여러분의
버전을 skipped로 보고하고 해답만 확인합니다.
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
