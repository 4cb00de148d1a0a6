"""Synthetic request traces shaped like the paper's two workloads, ShareGPT and Alpaca.

A trace is a list of requests, each with an arrival time, a prompt length and an output length
(in tokens). The PagedAttention paper replays real ShareGPT conversations and Alpaca
instructions; those datasets are NOT shipped with this project. Instead we draw lengths from a
distribution fitted to the published statistics, so that every run is reproducible offline.

The distribution: log-normal, rounded to whole tokens and clipped. A log-normal is positive and
right-skewed with a long tail, like real request lengths: most prompts are short, a few paste in
whole documents. With log-space mean mu and spread sigma its mean is exp(mu + sigma^2 / 2);
clipping to the model's maximum length cuts the tail and lowers the mean (by 2 % for ShareGPT
outputs), so ``fitted_mus`` picks mu such that the *clipped, rounded* lengths have the published
mean.

- means: the paper's Figure 11 (ShareGPT input 161.31, output 337.99 tokens; Alpaca input
  19.31, output 58.45);
- spreads: the paper gives no numbers, only histograms and the remark that ShareGPT lengths vary
  much more. Our sigmas are an assumption read loosely off those histograms: ShareGPT 1.0 for
  prompts and 0.9 for outputs (coefficient of variation about 1.3 and 1.1), Alpaca 0.7 and 0.8
  (about 0.8 and 0.95). In absolute terms ShareGPT's variance is then about 70 times Alpaca's.
- clipping: prompt + output <= max_len (2048 for OPT-13B, the paper's model), each >= 1 token.
  ``describe`` prints a trace's sample means beside the published ones.

Arrivals are a Poisson process of a given rate: gaps between arrivals are exponential with mean
1 / rate. Time is in simulator steps (one decode step of the whole batch), so rate is in
requests per step. Everything draws from one ``numpy.random.Generator`` seeded by the caller.
"""

import math
from dataclasses import dataclass
from functools import lru_cache
from statistics import NormalDist

import numpy as np


@dataclass(frozen=True)
class Request:
    request_id: int
    arrival: float  # simulator steps since the trace began
    prompt_len: int  # tokens
    output_len: int  # tokens the request will generate before it finishes


@dataclass(frozen=True)
class LengthModel:
    """Log-normal prompt and output lengths with given means (tokens) and log-space sigmas."""

    name: str
    prompt_mean: float
    prompt_sigma: float
    output_mean: float
    output_sigma: float

    def lengths(self, z_prompt: np.ndarray, z_output: np.ndarray, max_len: int,
                mus: tuple[float, float]) -> tuple[np.ndarray, np.ndarray]:
        """Standard normal draws -> clipped whole-token lengths (prompt, output)."""
        prompts = np.exp(mus[0] + self.prompt_sigma * z_prompt)
        outputs = np.exp(mus[1] + self.output_sigma * z_output)
        prompts = np.clip(np.rint(prompts), 1, max_len - 1)  # leave room for one output token
        outputs = np.clip(np.rint(outputs), 1, max_len - prompts)  # prompt + output <= max_len
        return prompts.astype(int), outputs.astype(int)


# Means: the paper's Figure 11. Sigmas: our assumption (see the module docstring).
SHAREGPT = LengthModel("sharegpt-like", prompt_mean=161.31, prompt_sigma=1.0,
                       output_mean=337.99, output_sigma=0.9)
ALPACA = LengthModel("alpaca-like", prompt_mean=19.31, prompt_sigma=0.7,
                     output_mean=58.45, output_sigma=0.8)
WORKLOADS = {"sharegpt": SHAREGPT, "alpaca": ALPACA}

# Evenly spaced quantiles of N(0, 1): a deterministic stand-in for an infinite sample. Outputs
# need the fine grid (their tail carries much of the mean); prompts only set the output's clip.
_Z_FINE = np.array([NormalDist().inv_cdf((i + 0.5) / 8192) for i in range(8192)])
_Z_COARSE = _Z_FINE[128::256]  # 32 quantiles


@lru_cache
def fitted_mus(model: LengthModel, max_len: int) -> tuple[float, float]:
    """Log-space means (prompt, output) whose clipped, rounded lengths have the target means.

    The clipped mean grows with mu, so bisection finds it. Expectations are taken over normal
    quantile grids (outputs over every pair of prompt and output quantiles, because the
    output's clip depends on the prompt).
    """
    def solve(target: float, sigma: float, clipped_mean) -> float:
        lo = math.log(target) - sigma**2 / 2 - 1  # exp(mu + sigma^2/2) == target without clipping
        hi = lo + 2
        for _ in range(30):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if clipped_mean(mid) < target else (lo, mid)
        return (lo + hi) / 2

    zp, zo = np.meshgrid(_Z_COARSE, _Z_FINE, indexing="ij")  # every (prompt, output) pair
    mu_p = solve(model.prompt_mean, model.prompt_sigma,
                 lambda mu: model.lengths(_Z_FINE, _Z_FINE, max_len, (mu, 0.0))[0].mean())
    mu_o = solve(model.output_mean, model.output_sigma,
                 lambda mu: model.lengths(zp, zo, max_len, (mu_p, mu))[1].mean())
    return mu_p, mu_o


# --8<-- [start:trace]
def synthetic_trace(workload: LengthModel | str, num_requests: int, rate: float,
                    seed: int = 0, max_len: int = 2048) -> list[Request]:
    """num_requests requests with Poisson arrivals (rate per step) and log-normal
    lengths."""
    model = WORKLOADS[workload] if isinstance(workload, str) else workload
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests per step, got {rate}")
    if max_len < 2:
        raise ValueError("max_len must be >= 2 (one prompt and one output token), got "
                         f"{max_len}")
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, num_requests))  # Poisson process
    # log-normal = exp(normal)
    z_prompt, z_output = rng.standard_normal((2, num_requests))
    prompts, outputs = model.lengths(z_prompt, z_output, max_len,
                                     fitted_mus(model, max_len))
    return [Request(i, float(a), int(p), int(o))
            for i, (a, p, o) in enumerate(zip(arrivals, prompts, outputs, strict=True))]
# --8<-- [end:trace]


def describe(trace: list[Request], model: LengthModel | None = None) -> str:
    """Sample statistics of a trace, beside the published means when the model is given."""
    p = np.array([r.prompt_len for r in trace])
    o = np.array([r.output_len for r in trace])
    line = (f"{len(trace)} requests: prompt mean {p.mean():.1f} (std {p.std():.1f}), "
            f"output mean {o.mean():.1f} (std {o.std():.1f}) tokens")
    if model is not None:
        line += (f"; published means {model.prompt_mean} and {model.output_mean} "
                 f"({model.name}, synthetic log-normal)")
    return line
