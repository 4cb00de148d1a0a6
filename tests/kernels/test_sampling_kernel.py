"""The sampling kernel, run by Triton's interpreter on the CPU, against its twin.

Tokens must be exactly the twin's; logprobs within LOGPROB_TOL. The in-kernel hash must give
the twin's uniforms bit for bit. Numpy's integer overflow and float warnings are errors here, so
the uint64 hash must wrap silently and no row may divide by zero or take exp(-inf + inf).
"""

import math
import random

import pytest
import torch

from pagedllm.kernels import sampling as kernel
from pagedllm.reference.ops import sampling as twin
from pagedllm.reference.ops.sampling import SamplingMetadata, SamplingRow

pytestmark = pytest.mark.filterwarnings("error")

LOGPROB_TOL = 1e-5  # float32 log-softmax, summed in another order than torch's
TILE = 128  # the kernel's tile in these tests, so that vocabularies span several tiles


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(kernel, "MAX_BLOCK", TILE)


def check(logits: torch.Tensor, rows: list[SamplingRow], exact_top_ids: bool = True):
    """The kernel's SamplerOutput against the twin's, for these logits and rows."""
    metadata = SamplingMetadata.from_rows(rows, logits.shape[-1])
    got, want = kernel.sample(logits, metadata), twin.sample(logits, metadata)
    assert got.token_ids.dtype == torch.int64 and got.logprobs.dtype == torch.float32
    assert got.token_ids.tolist() == want.token_ids.tolist()
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=LOGPROB_TOL, rtol=0)
    assert got.top_logprobs.shape == want.top_logprobs.shape
    assert got.top_token_ids.dtype == torch.int64
    torch.testing.assert_close(got.top_logprobs, want.top_logprobs, atol=LOGPROB_TOL, rtol=0)
    if exact_top_ids:
        assert torch.equal(got.top_token_ids, want.top_token_ids)
    else:  # ties: any of the tied ids will do, as long as they carry the reported values
        raw = torch.log_softmax(logits.float(), dim=-1)
        torch.testing.assert_close(raw.gather(1, got.top_token_ids), want.top_logprobs,
                                   atol=LOGPROB_TOL, rtol=0)
    return got


# ---- the hash ---------------------------------------------------------------------------------

STREAMS = [0, 1, -1, 42, -(2**63), 2**63 - 1, twin._int64(2**63 + 5), twin._int64(2**64 - 7),
           -123456789]
POSITIONS = [0, 0, 123456789, 2**40, 0, 7, 3, 1, 999]


@pytest.mark.parametrize("vocab", [1, 100, 1000])
def test_uniforms_match_the_twin_bit_for_bit(vocab):
    streams, positions = torch.tensor(STREAMS), torch.tensor(POSITIONS)
    got = kernel.random_uniform(streams, positions, vocab)
    want = twin.random_uniform(streams, positions, vocab)
    assert got.dtype == torch.float64
    assert torch.equal(got.view(torch.int64), want.view(torch.int64))  # every bit


def test_uniforms_match_hard_coded_values(monkeypatch):
    from tests.unit.test_sampler import KNOWN, VOCAB

    monkeypatch.setattr(kernel, "MAX_BLOCK", 4096)  # 50000 tokens in 13 tiles
    u = kernel.random_uniform(torch.tensor([key[0] for key, _ in KNOWN]),
                              torch.tensor([key[1] for key, _ in KNOWN]), VOCAB)
    for row, ((_, _, token), want) in enumerate(KNOWN):
        assert u[row, token].item() == want


# ---- the sampler ------------------------------------------------------------------------------

def random_rows(rng: random.Random, n: int, vocab: int, **fixed) -> list[SamplingRow]:
    rows = []
    for _ in range(n):
        params = dict(
            temperature=rng.choice([0.0, 1e-6, 1e-3, 0.3, 0.7, 1.0, 1.3, 2.5, 10.0]),
            top_k=rng.choice([-1, -1, 0, 1, 2, 5, 40, vocab - 1, vocab, vocab + 3]),
            top_p=rng.choice([1.0, 1.0, 0.99, 0.9, 0.5, 0.1]),
            stream=rng.randrange(-(2**63), 2**64),
            position=rng.randrange(0, 2**20),
            blocked_token_ids=rng.sample(range(vocab), rng.choice([0, 0, 1, 3])),
            num_logprobs=rng.choice([0, 1, 5]),
        )
        params.update(fixed)
        rows.append(SamplingRow(**params))
    return rows


@pytest.mark.parametrize("vocab", [64, 300, 1000])  # 300 and 1000 end with a partial tile
@pytest.mark.parametrize("scale", [0.5, 3.0, 12.0])
def test_random_batches_match_the_twin(vocab, scale):
    rng = random.Random(vocab * 100 + int(scale * 10))
    logits = torch.randn(24, vocab, generator=torch.Generator().manual_seed(vocab)) * scale
    check(logits, random_rows(rng, 24, vocab))


@pytest.mark.parametrize("temperature", [0.0, 1e-6, float(torch.tensor(1e-5)), 1e-5, 2e-5,
                                         1e-3, 0.05, 1.0, 4.0, 100.0])
def test_temperatures(temperature):
    logits = torch.randn(8, 200, generator=torch.Generator().manual_seed(1)) * 4
    rows = [SamplingRow(temperature=temperature, stream=i, position=3 * i, num_logprobs=2)
            for i in range(8)]
    got = check(logits, rows)
    if temperature < 1e-5:
        assert got.token_ids.tolist() == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize(("top_k", "top_p"), [(1, 1.0), (2, 1.0), (17, 1.0), (199, 1.0),
                                              (-1, 0.05), (-1, 0.5), (-1, 0.95),
                                              (10, 0.6), (3, 0.999)])
def test_top_k_and_top_p(top_k, top_p):
    logits = torch.randn(16, 200, generator=torch.Generator().manual_seed(2)) * 2
    rows = [SamplingRow(top_k=top_k, top_p=top_p, stream=-i, position=i) for i in range(16)]
    check(logits, rows)


def test_knife_edge_cuts_are_decided_like_the_twin():
    # Mass above a token exactly equal to top_p, ties across the top_k boundary, equal masses.
    cases = [([0.5, 0.25, 0.15, 0.1], dict(top_p=0.5)), ([0.5, 0.25, 0.15, 0.1], dict(top_p=0.75)),
             ([0.5, 0.25, 0.15, 0.1], dict(top_k=3, top_p=0.95)),
             ([0.3, 0.4, 0.3], dict(top_p=0.35)), ([0.3, 0.4, 0.3], dict(top_p=0.5)),
             ([0.25] * 4, dict(top_p=0.1)), ([0.4, 0.2, 0.2, 0.2], dict(top_k=2))]
    for probs, params in cases:
        logits = torch.log(torch.tensor(probs)).expand(64, -1)
        rows = [SamplingRow(stream=i, position=i % 7, **params) for i in range(64)]
        check(logits, rows)


def test_ties_many_equal_logits():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 4, (32, 257), generator=gen).float()  # four values, many ties
    logits[:4] = 1.0  # rows of one value: every token tied
    rng = random.Random(3)
    check(logits, random_rows(rng, 32, 257), exact_top_ids=False)
    flat = [SamplingRow(temperature=0.0, num_logprobs=3), SamplingRow(temperature=1.0, top_k=5),
            SamplingRow(top_p=0.5, stream=7), SamplingRow(top_k=2, top_p=0.3, stream=-2)]
    check(torch.zeros(4, 257), flat, exact_top_ids=False)


def test_seeds_and_positions():
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(4)).expand(24, -1)
    streams = [0, 1, -1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), 12345, -99999]
    rows = [SamplingRow(stream=streams[i % len(streams)], position=[0, 1, 2**31, 2**40][i % 4])
            for i in range(24)]
    got = check(logits, rows)
    assert len(set(got.token_ids.tolist())) > 1  # the seeds draw different tokens


def test_mixed_batch_and_each_row_alone():
    rng = random.Random(5)
    logits = torch.randn(12, 150, generator=torch.Generator().manual_seed(5)) * 3
    rows = random_rows(rng, 12, 150)
    together = check(logits, rows)
    for r in range(0, 12, 3):
        alone = check(logits[r:r + 1], rows[r:r + 1])
        assert alone.token_ids.item() == together.token_ids[r].item()


def test_blocked_tokens():
    logits = torch.randn(16, 90, generator=torch.Generator().manual_seed(6)) * 3
    top = logits.argmax(dim=-1).tolist()
    rows = [SamplingRow(temperature=0.0 if i % 2 else 0.8, stream=i,
                        blocked_token_ids=[top[i]] + ([0, 89] if i % 4 < 2 else []),
                        num_logprobs=1)
            for i in range(16)]
    got = check(logits, rows)
    for i, token in enumerate(got.token_ids.tolist()):
        assert token not in rows[i].blocked_token_ids


def test_bf16_logits_upcast_like_the_twin():
    logits = (torch.randn(8, 300, generator=torch.Generator().manual_seed(7)) * 3).bfloat16()
    check(logits, random_rows(random.Random(7), 8, 300))


def test_shapes_without_logprobs_and_empty_batch():
    logits = torch.randn(3, 70)
    got = check(logits, [SamplingRow(stream=i) for i in range(3)])
    assert got.top_logprobs.shape == (3, 0) and got.top_token_ids.shape == (3, 0)
    empty = SamplingMetadata.from_rows([], 70)
    out = kernel.sample(torch.zeros(0, 70), empty)
    assert out.token_ids.shape == (0,) and out.logprobs.shape == (0,)


def test_greedy_logprobs_are_the_raw_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    rows = [SamplingRow(temperature=0, blocked_token_ids=[0], num_logprobs=2)]
    got = check(logits, rows)
    assert got.token_ids.item() == 1 and abs(got.logprobs.item() - math.log(0.25)) < 1e-6


def test_without_the_interpreter_the_cpu_falls_back_to_the_twin(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    calls = []

    def spy(logits, metadata):
        calls.append(1)
        return twin.sample(logits, metadata)

    monkeypatch.setattr(kernel, "reference_sample", spy)
    logits = torch.randn(2, 50)
    metadata = SamplingMetadata.from_rows([SamplingRow(), SamplingRow(temperature=0)], 50)
    out = kernel.sample(logits, metadata)
    assert calls == [1]
    assert out.token_ids.tolist() == twin.sample(logits, metadata).token_ids.tolist()
    streams, positions = torch.tensor([3, -3]), torch.tensor([0, 5])
    assert torch.equal(kernel.random_uniform(streams, positions, 10),
                       twin.random_uniform(streams, positions, 10))
