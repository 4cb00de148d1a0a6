"""The compiled penalties kernel on CUDA against its twin on CUDA and on the CPU, bit for bit,
and the sampler's tokens with the controls (penalties, logit_bias, min_p) against the twin's."""

import random

import pytest
import torch

from pagedllm.kernels import penalties as kernel
from pagedllm.kernels import sampling as sampling_kernel
from pagedllm.reference.ops import sampling as twin
from pagedllm.reference.ops.sampling import SamplingMetadata, SamplingRow

VOCABS = [32000, 128256]


@pytest.fixture(autouse=True)
def _compiled(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def rows_for(vocab: int, seed: int, count: int = 32) -> list[SamplingRow]:
    rng = random.Random(seed)
    return [SamplingRow(
        temperature=rng.choice([0.0, 0.7, 1.0]), stream=rng.randrange(2**63),
        top_k=rng.choice([-1, 50]), min_p=rng.choice([0.0, 0.02, 0.2, 1.0]),
        repetition_penalty=rng.choice([1.0, 1.2, 0.8]),
        presence_penalty=rng.uniform(-2, 2), frequency_penalty=rng.uniform(-2, 2),
        logit_bias={t: rng.uniform(-100, 100) for t in rng.sample(range(vocab), 5)},
        prompt_token_ids=[rng.randrange(vocab) for _ in range(rng.randrange(1, 300))],
        output_token_ids=[rng.randrange(vocab) for _ in range(rng.randrange(0, 100))])
        for _ in range(count)]


@pytest.mark.parametrize("vocab", VOCABS)
def test_penalties_kernel_is_the_twin_bit_for_bit(vocab):
    rows = rows_for(vocab, vocab)
    logits = torch.randn(len(rows), vocab) * 4
    cpu = SamplingMetadata.from_rows(rows, vocab)
    cuda = SamplingMetadata.from_rows(rows, vocab, "cuda")
    got = kernel.apply_penalties(logits.cuda(), cuda.penalties)
    assert torch.equal(got, twin.apply_penalties(logits.cuda(), cuda.penalties))
    assert torch.equal(got.cpu(), twin.apply_penalties(logits, cpu.penalties))


@pytest.mark.parametrize("vocab", VOCABS)
def test_sampler_with_the_controls_draws_the_twins_tokens(vocab):
    rows = rows_for(vocab, vocab + 1)
    logits = torch.randn(len(rows), vocab, device="cuda") * 2
    metadata = SamplingMetadata.from_rows(rows, vocab, "cuda")
    got = sampling_kernel.sample(logits, metadata)
    want = twin.sample(logits, metadata)
    assert got.token_ids.tolist() == want.token_ids.tolist()
