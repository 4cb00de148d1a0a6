"""Speculative decoding's verification kernel (kernels/spec_decode.py) against its torch twin
(reference/ops/spec_decode.py), on the CPU through Triton's interpreter.

The op returns integers, so the kernel must give the twin's exactly: random proposals that
match the target's tokens at random places (long leading runs included), padding past
num_draft that happens to match (it must not count), no proposals at all (K = 0), every
proposal accepted, one run. The scheduler's ``verify_runs`` gathers its runs from the step's
sampled tokens and calls the op it is handed: with the kernel it gives the twin's counts.
The output is allocated with ``torch.empty`` and poisoned here, so a run the kernel forgets
to write shows. Last, the engine on the interpreted Triton backend verifies its runs with this
kernel (seen through ``launch_hook``) and gives plain decoding's tokens. The interpreter runs
one program at a time: small shapes, few examples.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm import reference
from pagedllm.kernels.backend import TRITON_OPS
from pagedllm.kernels.runtime import launch_hook
from pagedllm.kernels.spec_decode import accepted_lengths
from pagedllm.optimized.backend import INTERPRETED_BACKEND, TRITON_BACKEND
from pagedllm.reference.ops import REFERENCE_BACKEND
from pagedllm.reference.ops.spec_decode import accepted_lengths as accepted_lengths_reference
from pagedllm.reference.ops.spec_decode import verify_runs

POISON = -7  # what an unwritten output element holds


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    """TRITON_INTERPRET=1: kernel_runner reads it at every launch."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _poisoned_outputs(monkeypatch):
    """torch.empty returns integer tensors filled with POISON, so unwritten elements show."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t if t.is_floating_point() else t.fill_(POISON)

    monkeypatch.setattr(torch, "empty", empty)


def runs(gen: torch.Generator, B: int, K: int, match: float):
    """B runs of K proposal slots: each proposal equals the target's token with probability
    `match` (from a small vocabulary, so that chance matches happen too), num_draft in
    [0, K], and the padding past num_draft copied from the target (it must not count)."""
    target = torch.randint(0, 5, (B, K + 1), generator=gen)  # [B, K + 1]
    hit = torch.rand(B, K, generator=gen) < match  # [B, K]
    draft = torch.where(hit, target[:, :K], torch.randint(0, 5, (B, K), generator=gen))
    num = torch.randint(0, K + 1, (B,), generator=gen)  # [B]
    padding = torch.arange(K) >= num[:, None]  # [B, K]
    draft = torch.where(padding, target[:, :K], draft)  # [B, K]
    return target, draft, num


def check(target, draft, num):
    got = accepted_lengths(target, draft, num)
    expected = accepted_lengths_reference(target, draft, num)
    assert got.dtype == torch.int64 and got.shape == (target.shape[0],)
    assert (got != POISON).all(), "a run's count was not written"
    assert got.tolist() == expected.tolist()
    return got


@pytest.mark.parametrize("B, K, match", [(6, 4, 0.8), (5, 3, 0.3), (4, 8, 1.0), (3, 5, 0.0),
                                         (2, 1, 0.5)])
def test_random_matches_and_padding(B, K, match):
    gen = torch.Generator().manual_seed(B * 100 + K)
    check(*runs(gen, B, K, match))


def test_the_rule_by_hand():
    target = torch.tensor([[5, 6, 7, 8], [5, 9, 7, 8], [1, 2, 3, 4], [1, 2, 3, 4]])
    draft = torch.tensor([[5, 6, 7], [5, 6, 7], [9, 2, 3], [1, 2, 3]])
    num = torch.tensor([3, 3, 3, 2])  # the last run's third slot matches, but is padding
    assert check(target, draft, num).tolist() == [3, 1, 0, 2]


def test_no_proposals():
    """K = 0: every run keeps nothing and emits its one target token."""
    target = torch.tensor([[4], [9]])
    draft = torch.zeros(2, 0, dtype=torch.int64)
    assert check(target, draft, torch.zeros(2, dtype=torch.int64)).tolist() == [0, 0]


def test_all_accepted_and_one_run():
    target = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])  # B = 1, K = 7: a non-power-of-two K
    draft = target[:, :7].clone()
    assert check(target, draft, torch.tensor([7])).tolist() == [7]
    assert check(target, draft, torch.tensor([4])).tolist() == [4]  # capped by num_draft


def test_strided_inputs():
    """Runs sliced out of wider buffers (row strides the launcher passes through)."""
    wide = torch.randint(0, 3, (4, 12), generator=torch.Generator().manual_seed(1))
    target, draft = wide[:, :5], wide[:, 6:10]  # [4, 5] and [4, 4], both strided
    check(target, draft, torch.tensor([4, 2, 0, 3]))


def test_the_triton_ops_verify_with_the_kernel():
    """The optimized tier's Triton backends take TRITON_OPS' verification: this kernel."""
    assert TRITON_OPS.accepted_lengths is accepted_lengths
    assert TRITON_BACKEND.accepted_lengths is INTERPRETED_BACKEND.accepted_lengths \
        is accepted_lengths
    assert REFERENCE_BACKEND.accepted_lengths is accepted_lengths_reference


def test_verify_runs_through_the_kernel():
    """The scheduler's call: runs gathered from one step's sampled tokens, padded to the
    longest, a one-row plain token in between; a short run near the end (its padding rows
    would run past the last row)."""
    token_ids = torch.tensor([5, 6, 7, 8, 42, 1, 2, 3, 9, 9])  # [S]
    first_rows, drafts = [0, 5, 8], [[5, 6, 7], [1, 5], [9]]
    expected = verify_runs(token_ids, first_rows, drafts)  # the twin
    assert expected == [3, 1, 1]
    assert verify_runs(token_ids, first_rows, drafts, accepted_lengths) == expected


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(B=st.integers(1, 4), K=st.integers(0, 6), match=st.sampled_from([0.0, 0.5, 0.9, 1.0]),
       seed=st.integers(0, 2**16))
def test_matches_the_twin(B, K, match, seed):
    check(*runs(torch.Generator().manual_seed(seed), B, K, match))


def test_the_engine_verifies_with_the_kernel(checkpoints):
    """n-gram speculation on the interpreted Triton backend: the scheduler's verification
    launches this kernel, and the tokens are plain decoding's. The prompts' greedy
    continuations on the tiny llama3 repeat their own tokens, so lookups hit."""
    prompts = [{"prompt_token_ids": [90, 34, 125, 32, 182, 130, 112, 12]},
               {"prompt_token_ids": [62, 159, 79, 159, 25, 183, 225, 134]}]
    params = reference.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = reference.LLM(checkpoints["llama3"], block_size=8).generate(
        prompts, params, use_tqdm=False)
    llm = reference.LLM(checkpoints["llama3"], block_size=8, backend=INTERPRETED_BACKEND,
                        speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                            "prompt_lookup_max": 2})
    launched = []
    with launch_hook(lambda kernel, grid, args, kwargs: launched.append(kernel.__name__)):
        spec = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert llm.stats()["spec_decode_num_drafts"] > 0
    assert "_accepted_lengths_kernel" in launched
