"""A solution to lesson 16's exercise: top-k and top-p with ties, and the exponential race.

One row in plain Python. The reference (reference/ops/sampling.py) does the same for a batch of
rows with one sort: top_k compares with the k-th sorted value, and top_p reads, for each token,
the exclusive cumulative sum at the first position of its tie group — the mass of the tokens
strictly more probable than it. The double loop below computes that mass directly.
"""

import math


def top_k_top_p(logits: list[float], top_k: int, top_p: float) -> list[float]:
    """The renormalised distribution after top_k, then top_p (tied tokens kept together)."""
    vocab = len(logits)
    if 0 < top_k < vocab:
        kth = sorted(logits, reverse=True)[top_k - 1]
        logits = [z if z >= kth else -math.inf for z in logits]
    largest = max(logits)
    weights = [math.exp(z - largest) for z in logits]  # exp(-inf) = 0.0
    total = sum(weights)
    probs = [w / total for w in weights]
    if top_p < 1:
        # A token's mass above: everything strictly more probable. Equal tokens see the same
        # mass, so they are kept or cut together, whatever order a sort would put them in.
        probs = [p if p > 0 and sum(q for q in probs if q > p) < top_p else 0.0 for p in probs]
        total = sum(probs)
        probs = [p / total for p in probs]
    return probs


def race(probs: list[float], uniforms: list[float]) -> int:
    """argmax_i probs[i] / E_i with E_i = -log(U_i): the first of the exponential clocks."""
    best, best_score = 0, -1.0
    for i, (p, u) in enumerate(zip(probs, uniforms, strict=True)):
        score = p / -math.log(u)
        if score > best_score:  # strictly greater: the first index wins a tie
            best, best_score = i, score
    return best
