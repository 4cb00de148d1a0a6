"""Exercise (lesson 16, "Sampling: logits to tokens"): the cuts and the draw, for one row.

The reference sampler (reference/ops/sampling.py) works on a whole batch of rows at once with
sorts, cumulative sums and scatters. Here you write the same mechanism for one row, in plain
Python: a list of floats in, a list of floats or one token id out. Check your work with

    pytest lessons/exercises/test_sampling_exercise.py

The test compares your functions with the reference's ``_top_k_top_p`` and ``sample`` on rows
full of ties, and runs your race on the reference's own random numbers. Until you edit this file
the test reports your version as skipped and checks only the solution.

한국어:
연습 문제(16강, "샘플링: 로짓에서 토큰으로"): 한 행에 대한 잘라내기와 뽑기.

레퍼런스 샘플러(reference/ops/sampling.py)는 정렬, 누적 합, scatter로 행의 배치 전체를 한 번에
처리합니다. 여기서는 같은 메커니즘을 한 행에 대해 순수 Python으로 작성합니다: float 리스트를 받아
float 리스트나 토큰 id 하나를 내놓습니다. 다음 명령으로 확인하세요:

    pytest lessons/exercises/test_sampling_exercise.py

테스트는 동점이 가득한 행에서 여러분의 함수를 레퍼런스의 ``_top_k_top_p``, ``sample``과 비교하고,
레퍼런스 자신의 난수로 여러분의 경주를 돌립니다. 이 파일을 고치기 전까지 테스트는 여러분의 버전을
skipped로 보고하고 해답만 확인합니다.
"""

import math  # noqa: F401  (you will want math.exp and math.log)


def top_k_top_p(logits: list[float], top_k: int, top_p: float) -> list[float]:
    """The distribution one row is sampled from, given its logits already divided by the
    temperature: probabilities in vocabulary order, 0.0 for every token cut, summing to 1.

    top_k: keep the tokens whose logit is at least the k-th largest logit; top_k <= 0 or
           top_k >= len(logits) keeps every token.
    top_p: on the softmax of what top_k kept, keep a token when the total probability of the
           tokens strictly more probable than it is below top_p; top_p = 1.0 keeps every token.
    Then renormalise what is left so that it sums to 1.

    Tied tokens survive or fall together, for both cuts: logits [2, 1, 1, 0] with top_k = 2
    keep three tokens.
    """
    # 1. top_k: find the k-th largest logit (sorted(logits, reverse=True)[k - 1]); every logit
    #    strictly below it is out (treat it as -inf, probability 0).
    # 2. softmax over the survivors (subtract the largest logit before math.exp).
    # 3. top_p (only when top_p < 1): for each surviving token, add up the probabilities of the
    #    tokens whose probability is strictly larger than its own. Keep it if that sum is
    #    below top_p. (A sort makes this fast; a double loop is fine for a test.)
    # 4. Divide what is left by its sum.
    raise NotImplementedError("exercise: implement top_k_top_p")


def race(probs: list[float], uniforms: list[float]) -> int:
    """The token the exponential race picks: every token i gets an exponential waiting time
    E_i = -log(U_i) from its uniform number U_i in (0, 1), and runs at rate probs[i]; the
    token that arrives first wins. A token of probability 0 never arrives.

    Return the index of the winner (the first index if two arrive at exactly the same time).
    """
    # Token i arrives at time E_i / probs[i]. The earliest arrival is the largest
    # probs[i] / E_i, which needs no division by zero for a cut token.
    raise NotImplementedError("exercise: implement race")

