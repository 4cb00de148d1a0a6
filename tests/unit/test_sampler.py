"""The batched sampler draws from the distribution the parameters describe, reproducibly: its
random numbers are a fixed hash of (stream, position, token), checked here against a plain-Python
copy of the hash and against hard-coded values, so the Triton tier can be held to the same bits."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.reference.ops.sampling import (
    SamplingMetadata,
    SamplingRow,
    random_uniform,
    sample,
)

# ---- the hash, in plain Python ints masked to 64 bits ----------------------------------------

MASK = 2**64 - 1
GAMMA = 0x9E3779B97F4A7C15


def mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def python_uniform(stream: int, position: int, token: int) -> float:
    a = mix64((stream + GAMMA) & MASK)
    b = mix64((a + (position + 1) * GAMMA) & MASK)
    x = mix64((b + (token + 1) * GAMMA) & MASK)
    return ((x >> 12) + 0.5) * 2.0**-52


def test_python_hash_is_splitmix64():
    # Published SplitMix64 outputs for seed 0: the k-th output is mix64(k * GAMMA).
    assert [mix64(k * GAMMA & MASK) for k in (1, 2, 3)] == [
        0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


VOCAB = 50_000
# (stream as int64, position, token) -> U, computed once by python_uniform and pasted here.
KNOWN = [
    ((0, 0, 0), 0.13870941014555427),
    ((0, 0, VOCAB - 1), 0.6822681891185919),
    ((1, 0, 0), 0.6935121390102293),
    ((0, 1, 0), 0.18383979100743952),
    ((2**63 - 1, 0, 0), 0.3975405827620021),
    ((2**63 - 1, 7, VOCAB - 1), 0.24843294957135809),
    ((-(2**63), 0, 0), 0.14469613653558888),  # seed 2**63 - 1, sample 1: wrapped
    ((-1, 123456789, 0), 0.8616091961066904),  # seed 2**64 - 1: wrapped
    ((-1, 0, VOCAB - 1), 0.7000363983593175),
    ((42, 2**40, 31337), 0.5510852705431794),
]


def test_random_uniform_matches_hard_coded_values():
    streams = torch.tensor([key[0] for key, _ in KNOWN])
    positions = torch.tensor([key[1] for key, _ in KNOWN])
    u = random_uniform(streams, positions, VOCAB)  # [10, VOCAB]
    assert u.dtype == torch.float64 and u.shape == (len(KNOWN), VOCAB)
    for row, ((stream, position, token), want) in enumerate(KNOWN):
        assert u[row, token].item() == want  # bit for bit
        assert python_uniform(stream & MASK, position, token) == want


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(-(2**63), 2**63 - 1), st.integers(0, 2**40)),
                min_size=1, max_size=4))
def test_random_uniform_matches_the_python_hash(rows):
    u = random_uniform(torch.tensor([s for s, _ in rows]), torch.tensor([p for _, p in rows]), 7)
    for r, (stream, position) in enumerate(rows):
        assert u[r].tolist() == [python_uniform(stream & MASK, position, t) for t in range(7)]


def test_random_uniform_looks_uniform_and_distinct():
    streams = torch.arange(64) * 1_000_003 - 2**40
    positions = torch.arange(64) % 5
    u = random_uniform(streams, positions, 4096).flatten()  # 262144 values
    n = u.numel()
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 4 * math.sqrt(1 / 12 / n)
    counts = torch.histc(u, bins=16, min=0, max=1)  # each bin ~ n / 16, sd ~ sqrt(n / 16)
    assert (counts - n / 16).abs().max() < 5 * math.sqrt(n / 16)
    assert u.unique().numel() == n  # no repeats across streams, positions or tokens
    one = random_uniform(torch.tensor([5, 6, 5]), torch.tensor([0, 0, 1]), 3)
    assert one.unique().numel() == 9


# ---- the sampler ------------------------------------------------------------------------------

PROBS = [0.5, 0.25, 0.15, 0.1]


def batch(probs: list[float], rows: int, **params) -> tuple[torch.Tensor, SamplingMetadata]:
    """`rows` rows of the same distribution, each with its own stream and position."""
    logits = torch.log(torch.tensor(probs)).expand(rows, -1)
    metadata = SamplingMetadata.from_rows(
        [SamplingRow(stream=i, position=i % 7, **params) for i in range(rows)], len(probs))
    return logits, metadata


def frequencies(probs: list[float], rows: int = 20_000, **params) -> list[float]:
    tokens = sample(*batch(probs, rows, **params)).token_ids
    return (torch.bincount(tokens, minlength=len(probs)) / rows).tolist()


def close(freq: list[float], want: list[float], rows: int = 20_000) -> bool:
    """Within 4 standard errors of the binomial frequency (under 0.015 at 20000 rows)."""
    return all(abs(f - w) < 4 * math.sqrt(w * (1 - w) / rows) + 1e-9
               for f, w in zip(freq, want, strict=True))


def test_greedy_picks_the_argmax_and_reports_logprobs():
    logits, metadata = batch(PROBS, 3, temperature=0.0, num_logprobs=2)
    out = sample(logits, metadata)
    assert out.token_ids.tolist() == [0, 0, 0]
    assert torch.allclose(out.logprobs, torch.full((3,), math.log(0.5)))
    assert out.top_token_ids.tolist() == [[0, 1]] * 3
    assert torch.allclose(out.top_logprobs, torch.log(torch.tensor([[0.5, 0.25]] * 3)))
    assert out.logprobs.dtype == torch.float32 and out.top_token_ids.dtype == torch.int64
    tied = SamplingMetadata.from_rows([SamplingRow(temperature=0.0)], 3)
    assert sample(torch.tensor([[1.0, 3.0, 3.0]]), tied).token_ids.item() == 1  # first of ties


def test_no_logprobs_gives_empty_columns():
    out = sample(*batch(PROBS, 5))
    assert out.top_logprobs.shape == (5, 0) and out.top_token_ids.shape == (5, 0)


def test_temperature_one_follows_the_distribution():
    assert close(frequencies(PROBS), PROBS)


def test_temperature_reshapes_the_distribution():
    hot = [p**0.5 for p in PROBS]  # temperature 2: p ** (1/2), renormalised
    assert close(frequencies(PROBS, temperature=2.0), [p / sum(hot) for p in hot])


def test_top_k_and_top_p_cut_the_tail():
    assert close(frequencies(PROBS, top_k=2), [2 / 3, 1 / 3, 0, 0])
    # Mass strictly above each token: 0, 0.5, 0.75, 0.9. top_p 0.7 keeps the first two...
    assert close(frequencies(PROBS, top_p=0.7), [2 / 3, 1 / 3, 0, 0])
    # ...and top_p 0.5 only the first: 0.5 above the second token is not below 0.5.
    assert frequencies(PROBS, top_p=0.5) == [1.0, 0.0, 0.0, 0.0]
    assert close(frequencies(PROBS, top_k=3, top_p=0.95), [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0])


def test_tied_tokens_are_kept_or_dropped_together():
    # Mass strictly above tokens 0 and 2 is 0.4, whichever of them a sort puts first.
    assert close(frequencies([0.3, 0.4, 0.3], top_p=0.5), [0.3, 0.4, 0.3])
    assert frequencies([0.3, 0.4, 0.3], top_p=0.35) == [0.0, 1.0, 0.0]
    assert close(frequencies([0.25] * 4, top_p=0.1), [0.25] * 4)  # nothing above any token
    # top_k: only what is strictly below the k-th largest value goes.
    assert close(frequencies([0.4, 0.2, 0.2, 0.2], top_k=2), [0.4, 0.2, 0.2, 0.2])


def test_tiny_temperature_is_greedy():
    assert frequencies(PROBS, rows=500, temperature=1e-6) == [1.0, 0.0, 0.0, 0.0]
    # 1e-3 is not greedy, but p ** 1000 leaves the first token alone all the same.
    assert frequencies(PROBS, rows=500, temperature=1e-3) == [1.0, 0.0, 0.0, 0.0]


def test_blocked_tokens_are_never_drawn():
    logits = torch.log(torch.tensor(PROBS)).expand(4000, -1)
    rows = [SamplingRow(stream=i, blocked_token_ids=[0, 3] if i % 2 else [0]) for i in range(4000)]
    tokens = sample(logits, SamplingMetadata.from_rows(rows, 4)).token_ids
    assert (tokens != 0).all() and (tokens[1::2] != 3).all() and (tokens[0::2] == 3).any()
    greedy = SamplingMetadata.from_rows([SamplingRow(temperature=0, blocked_token_ids=[0])], 4)
    out = sample(logits[:1], greedy)
    assert out.token_ids.item() == 1 and abs(out.logprobs.item() - math.log(0.25)) < 1e-6  # raw


def test_metadata_from_rows():
    rows = [SamplingRow(stream=2**64 - 1, blocked_token_ids=[5, 6], num_logprobs=1),
            SamplingRow(stream=2**63, top_k=3, num_logprobs=4)]
    m = SamplingMetadata.from_rows(rows, 10)
    assert m.streams.tolist() == [-1, -(2**63)]  # seed + index, wrapped to int64
    assert m.blocked_token_ids.tolist() == [[5, 6], [-1, -1]] and m.num_logprobs == 4
    assert m.top_k.tolist() == [-1, 3] and m.temperature.dtype == torch.float32
    empty = SamplingMetadata.from_rows([SamplingRow()], 10)
    assert empty.blocked_token_ids.shape == (1, 0)
    try:
        SamplingMetadata.from_rows([SamplingRow(blocked_token_ids=[10])], 10)
    except ValueError:
        pass
    else:
        raise AssertionError("a blocked token outside the vocabulary was accepted")


def test_seeded_draws_repeat_and_seeds_differ():
    def draws(stream: int) -> list[int]:
        rows = [SamplingRow(temperature=0.8, stream=stream, position=p) for p in range(50)]
        logits = torch.log(torch.tensor(PROBS)).expand(50, -1)
        return sample(logits, SamplingMetadata.from_rows(rows, 4)).token_ids.tolist()

    assert draws(9) == draws(9) and len(set(draws(9))) > 1
    assert draws(9) != draws(10)


row_strategy = st.builds(
    SamplingRow,
    temperature=st.sampled_from([0.0, 0.5, 1.0, 1.7]),
    top_k=st.sampled_from([-1, 1, 3, 20]),
    top_p=st.sampled_from([0.3, 0.9, 1.0]),
    stream=st.integers(-(2**63), 2**64),
    position=st.integers(0, 1000),
    blocked_token_ids=st.lists(st.integers(0, 11), max_size=3),
    num_logprobs=st.integers(0, 3),
)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(row_strategy, st.integers(0, 2**31)), min_size=1, max_size=6),
       st.randoms(use_true_random=False))
def test_a_row_depends_only_on_its_own_logits_and_metadata(rows, rng):
    logits = torch.stack([torch.randn(12, generator=torch.Generator().manual_seed(seed)) * 3
                          for _, seed in rows])  # [S, 12]
    params = [row for row, _ in rows]
    together = sample(logits, SamplingMetadata.from_rows(params, 12))
    order = list(range(len(rows)))
    rng.shuffle(order)
    shuffled = sample(logits[order], SamplingMetadata.from_rows([params[i] for i in order], 12))
    for r, row in enumerate(params):
        alone = sample(logits[r:r + 1], SamplingMetadata.from_rows([row], 12))
        s = order.index(r)
        k = row.num_logprobs
        for out, i in [(together, r), (shuffled, s)]:
            assert out.token_ids[i] == alone.token_ids[0]
            assert out.token_ids[i].item() not in row.blocked_token_ids
            assert out.logprobs[i] == alone.logprobs[0]
            assert torch.equal(out.top_token_ids[i, :k], alone.top_token_ids[0])
            assert torch.equal(out.top_logprobs[i, :k], alone.top_logprobs[0])
