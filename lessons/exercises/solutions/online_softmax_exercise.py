"""Solution to lesson 11's exercise: partial results (m, l, acc) and their merge."""

import torch

Partial = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _safe(m: torch.Tensor) -> torch.Tensor:
    """The max to subtract: 0 where a row has seen nothing (m = -inf), so no -inf - -inf."""
    return torch.where(m == float("-inf"), torch.zeros_like(m), m)


def partial(scores: torch.Tensor, values: torch.Tensor) -> Partial:
    m = scores.max(dim=1).values  # [rows]
    p = torch.exp(scores - _safe(m)[:, None])  # [rows, n]; exp(-inf) = 0
    return m, p.sum(dim=1), p @ values


def merge(a: Partial, b: Partial) -> Partial:
    m_a, l_a, acc_a = a
    m_b, l_b, acc_b = b
    m = torch.maximum(m_a, m_b)
    alpha = torch.exp(m_a - _safe(m))  # <= 1: what a was summed against, rescaled to m
    beta = torch.exp(m_b - _safe(m))
    return m, l_a * alpha + l_b * beta, acc_a * alpha[:, None] + acc_b * beta[:, None]


def finish(p: Partial) -> torch.Tensor:
    _, l, acc = p
    return acc / torch.where(l > 0, l, torch.ones_like(l))[:, None]
