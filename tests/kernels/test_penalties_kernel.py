"""logit_bias, the penalties and min_p in the optimized tier, run by Triton's interpreter on the
CPU, against their twins: the penalties kernel bit for bit, the sampler's tokens exactly."""

import random

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
