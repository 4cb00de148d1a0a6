"""The grammar's token bitmask in the optimized tier, run by Triton's interpreter on the CPU:
the kernel against its twin bit for bit, and the sampler with a bitmask (and penalties)
drawing the twin's tokens, never a forbidden one."""

import random

import pytest
import torch

from pagedllm.kernels import sampling as sampling_kernel
from pagedllm.kernels import token_bitmask as kernel
from pagedllm.reference.ops import sampling as twin
from pagedllm.reference.ops.sampling import SamplingMetadata, SamplingRow, unpack_bitmask

pytestmark = pytest.mark.filterwarnings("error")


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def random_bitmask(rows: int, vocab: int, seed: int, density: float = 0.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    allowed = torch.rand(rows, (vocab + 31) // 32 * 32, generator=g) < density
    weights = torch.tensor([1 << b for b in range(32)], dtype=torch.int64)
    words = (allowed.view(rows, -1, 32).long() * weights).sum(-1)  # [rows, words] in [0, 2**32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@pytest.mark.parametrize("vocab", [1, 33, 1100, 2100])  # one tile, and more than two
def test_the_kernel_matches_the_twin_bit_for_bit(vocab):
    logits = torch.randn(5, vocab) * 3
    logits[0, 0] = float("-inf")  # already blocked stays blocked
    bitmask = random_bitmask(5, vocab, vocab)
    bitmask[1] = -1  # a row without a grammar allows everything
    bitmask[2] = 0
    bitmask[2, -1] = -2**31  # only bit 31 of the last word (beyond a small vocabulary: none)
    got = kernel.apply_token_bitmask(logits, bitmask)
    want = twin.apply_token_bitmask(logits, bitmask)
    assert torch.equal(got, want)
    assert torch.equal(torch.isfinite(got[1:2]), torch.isfinite(logits[1:2]))


@pytest.mark.parametrize("seed", range(3))
def test_the_sampler_with_a_bitmask_matches_the_twin(seed):
    rng = random.Random(seed)
    vocab = 150
    rows = [SamplingRow(temperature=rng.choice([0.0, 0.7, 1.0, 1.6]), stream=i, position=i,
                        top_k=rng.choice([-1, 5]), top_p=rng.choice([1.0, 0.8]),
                        repetition_penalty=rng.choice([1.0, 1.3]),
                        output_token_ids=[rng.randrange(vocab) for _ in range(3)],
                        logit_bias={3: 5.0} if i % 2 else {})
            for i in range(8)]
    bitmask = random_bitmask(8, vocab, seed, density=0.1)
    bitmask[:, 0] |= 1  # every row allows token 0 at least
    metadata = SamplingMetadata.from_rows(rows, vocab, token_bitmask=bitmask)
    logits = torch.randn(8, vocab) * 2
    got = sampling_kernel.sample(logits, metadata)
    want = twin.sample(logits, metadata)
    assert got.token_ids.tolist() == want.token_ids.tolist()
    allowed = unpack_bitmask(bitmask, vocab)
    assert bool(allowed.gather(1, got.token_ids[:, None]).all())
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=0)
