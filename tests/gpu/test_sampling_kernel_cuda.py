"""The compiled sampling kernel on CUDA against its twin on CUDA, at real vocabulary sizes.

Tokens must be exactly the twin's; the in-kernel uniforms bit for bit; logprobs within
LOGPROB_TOL (float32 log-softmax over up to 128256 terms, summed in another order than torch's).
"""

import random

import pytest
import torch

from pagedllm.kernels import sampling as kernel
from pagedllm.reference.ops import sampling as twin
from pagedllm.reference.ops.sampling import SamplingMetadata, SamplingRow

LOGPROB_TOL = 1e-4
VOCABS = [32000, 49152, 128256]
BATCH = 64


@pytest.fixture(autouse=True)
def _compiled(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the compiled kernel, not numpy


def rows_for(vocab: int, seed: int, **fixed) -> list[SamplingRow]:
    rng = random.Random(seed)
    rows = []
    for _ in range(BATCH):
        params = dict(
            temperature=rng.choice([0.0, 1e-6, 1e-3, 0.3, 0.7, 1.0, 1.0, 1.5, 5.0]),
            top_k=rng.choice([-1, -1, 0, 1, 2, 20, 50, 1000, vocab]),
            top_p=rng.choice([1.0, 1.0, 0.99, 0.95, 0.9, 0.5, 0.1]),
            stream=rng.randrange(-(2**63), 2**64),
            position=rng.randrange(0, 2**20),
            blocked_token_ids=rng.sample(range(vocab), rng.choice([0, 0, 1, 2, 8])),
            num_logprobs=rng.choice([0, 1, 5, 20]),
        )
        params.update(fixed)
        rows.append(SamplingRow(**params))
    return rows


def logits_for(vocab: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(BATCH, vocab, generator=gen) * 3  # a trained model's spread
    logits[: BATCH // 4] = torch.randint(0, 5, (BATCH // 4, vocab), generator=gen).float()  # ties
    return logits.to(dtype).cuda()


def check(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    metadata = SamplingMetadata.from_rows(rows, logits.shape[-1], device="cuda")
    got, want = kernel.sample(logits, metadata), twin.sample(logits, metadata)
    assert got.token_ids.is_cuda and got.token_ids.dtype == torch.int64
    assert got.token_ids.tolist() == want.token_ids.tolist()
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=LOGPROB_TOL, rtol=0)
    torch.testing.assert_close(got.top_logprobs, want.top_logprobs, atol=LOGPROB_TOL, rtol=0)
    raw = torch.log_softmax(logits.float(), dim=-1)  # tied ids may come in another order
    torch.testing.assert_close(raw.gather(1, got.top_token_ids), want.top_logprobs,
                               atol=LOGPROB_TOL, rtol=0)


@pytest.mark.parametrize("vocab", VOCABS)
def test_uniforms_match_the_twin_bit_for_bit(vocab):
    gen = torch.Generator().manual_seed(vocab)
    streams = torch.randint(-(2**63), 2**63 - 1, (BATCH,), generator=gen).cuda()
    streams[:4] = torch.tensor([0, -1, -(2**63), 2**63 - 1])
    positions = torch.randint(0, 2**40, (BATCH,), generator=gen).cuda()
    got = kernel.random_uniform(streams, positions, vocab)
    want = twin.random_uniform(streams, positions, vocab)
    assert torch.equal(got.view(torch.int64), want.view(torch.int64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("vocab", VOCABS)
def test_random_batches_match_the_twin(vocab, dtype):
    check(logits_for(vocab, vocab, dtype), rows_for(vocab, vocab))


@pytest.mark.parametrize("vocab", VOCABS)
def test_greedy_and_drawn_rows_without_cuts(vocab):
    logits = logits_for(vocab, vocab + 1, torch.float32)
    check(logits, rows_for(vocab, vocab + 1, top_k=-1, top_p=1.0))
    check(logits, rows_for(vocab, vocab + 2, temperature=0.0))


def test_many_draws_of_one_row():
    """One distribution drawn with 64 streams at 3 positions: every draw is the twin's."""
    logits = logits_for(128256, 5, torch.float32)[BATCH // 2].expand(BATCH, -1).contiguous()
    for position in range(3):
        rows = [SamplingRow(temperature=0.8, top_p=0.95, stream=s, position=position)
                for s in range(BATCH)]
        check(logits, rows)
