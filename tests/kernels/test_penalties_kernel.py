"""logit_bias, the penalties and min_p in the optimized tier, run by Triton's interpreter on the
CPU, against their twins: the penalties kernel bit for bit, the sampler's tokens exactly."""

import random
import warnings

import pytest
import torch

from pagedllm.kernels import penalties as kernel
from pagedllm.kernels import sampling as sampling_kernel
from pagedllm.reference.ops import sampling as twin
from pagedllm.reference.ops.sampling import SamplingMetadata, SamplingRow

pytestmark = pytest.mark.filterwarnings("error")


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def random_rows(rng: random.Random, vocab: int, count: int) -> list[SamplingRow]:
    rows = []
    for i in range(count):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))]
        rows.append(SamplingRow(
            temperature=rng.choice([0.0, 0.7, 1.0, 1.6]), stream=i, position=len(ids),
            top_k=rng.choice([-1, -1, 5]), top_p=rng.choice([1.0, 1.0, 0.8]),
            min_p=rng.choice([0.0, 0.05, 0.3, 1.0]),
            repetition_penalty=rng.choice([1.0, 1.3, 0.7]),
            presence_penalty=rng.choice([0.0, 2.0, -1.5]),
            frequency_penalty=rng.choice([0.0, 0.4, -2.0]),
            logit_bias={t: rng.uniform(-100, 100) for t in rng.sample(range(vocab), min(3, vocab))}
            if rng.random() < 0.5 else {},
            prompt_token_ids=[rng.randrange(vocab) for _ in range(rng.randrange(1, 9))],
            output_token_ids=ids,
            blocked_token_ids=[rng.randrange(vocab)] if rng.random() < 0.3 else []))
    return rows


@pytest.mark.parametrize("vocab", [1, 37, 1100])  # one tile, and a vocabulary over two tiles
def test_penalties_kernel_matches_the_twin_bit_for_bit(vocab):
    rng = random.Random(vocab)
    rows = random_rows(rng, vocab, 6)
    rows[0].repetition_penalty = 1.2  # at least one row transforms its logits
    metadata = SamplingMetadata.from_rows(rows, vocab)
    logits = torch.randn(6, vocab) * 3
    logits[0, 0] = 0.0  # neither positive nor negative
    logits[1, -1] = float("-inf")  # a blocked token stays blocked
    got = kernel.apply_penalties(logits, metadata.penalties)
    want = twin.apply_penalties(logits, metadata.penalties)
    assert torch.equal(got, want)


@pytest.mark.parametrize("seed", range(3))
def test_sampler_with_the_controls_matches_the_twin(seed):
    rng = random.Random(seed)
    vocab = 150
    rows = random_rows(rng, vocab, 8)
    rows[0].logit_bias = {3: 100.0}
    metadata = SamplingMetadata.from_rows(rows, vocab)
    logits = torch.randn(8, vocab) * 2
    got = sampling_kernel.sample(logits, metadata)
    want = twin.sample(logits, metadata)
    assert got.token_ids.tolist() == want.token_ids.tolist()
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=0)


# Issue 38: a tiny repetition_penalty divides a seen token's positive logit past float32's
# largest number (and a small temperature divides it again): +inf there made the softmax NaN
# and the drawn token 0. Both the twin and the kernels saturate at float32's largest number.
EXTREME_PENALTIES = [1e-37, 1e-40, 1e-45, 1e-300, 5e-324, 1e30, twin.FLOAT32_MAX]


def interpreted(launch, *args):
    """launch(*args) with numpy's floating-point warnings silenced: the interpreter computes
    with numpy, which warns of the overflow the kernels then saturate (this module's warnings
    are errors, and a mark on the test cannot override the module's). What the arithmetic
    gives is what the tests check."""
    with warnings.catch_warnings():
        for what in ("overflow", "divide by zero", "invalid value"):
            warnings.filterwarnings("ignore", f"{what} encountered", RuntimeWarning)
        return launch(*args)


def extreme_rows(vocab: int) -> tuple[list[SamplingRow], torch.Tensor]:
    """One row per extreme penalty, every fourth token but 0 seen (in the prompt), logits
    large enough to overflow in both directions, and a blocked token per row."""
    seen = list(range(4, vocab, 4))
    rows = [SamplingRow(repetition_penalty=r, prompt_token_ids=seen, output_token_ids=seen[:3],
                        presence_penalty=-2.0, frequency_penalty=-2.0, stream=i,
                        blocked_token_ids=[1]) for i, r in enumerate(EXTREME_PENALTIES)]
    logits = torch.randn(len(rows), vocab) * 3
    logits[:, 12] = 0.0  # neither positive nor negative
    logits[:, 4] = 30.0  # a seen token far above the rest
    logits[:, 8] = -30.0
    logits[:, 1] = float("-inf")  # a blocked token stays blocked
    return rows, logits


@pytest.mark.parametrize("vocab", [37, 1100])
def test_penalties_kernel_saturates_like_the_twin(vocab):
    rows, logits = extreme_rows(vocab)
    metadata = SamplingMetadata.from_rows(rows, vocab)
    got = interpreted(kernel.apply_penalties, logits, metadata.penalties)
    want = twin.apply_penalties(logits, metadata.penalties)
    assert torch.equal(got, want)
    assert not got.isnan().any()
    assert torch.equal(got.isinf(), logits.isinf())  # only the blocked token is -inf
    assert (got[1:5, 4] == twin.FLOAT32_MAX).all()  # past float32: as large as it goes


@pytest.mark.parametrize("temperature", [1e-5, 1e-3, 1.0])
def test_sampler_with_a_tiny_repetition_penalty_draws_a_seen_token(temperature):
    vocab = 150
    rows, logits = extreme_rows(vocab)
    rows = rows[:5]  # the tiny penalties
    logits = logits[:5]
    for row in rows:
        row.temperature = temperature
        row.top_p = 0.9 if row.stream % 2 else 1.0
    metadata = SamplingMetadata.from_rows(rows, vocab)
    got = interpreted(sampling_kernel.sample, logits, metadata)
    want = twin.sample(logits, metadata)
    assert got.token_ids.tolist() == want.token_ids.tolist()
    seen = set(range(4, vocab, 4))
    assert set(got.token_ids.tolist()) <= seen, got.token_ids  # never NaN's token 0
    assert got.logprobs.isfinite().all()
