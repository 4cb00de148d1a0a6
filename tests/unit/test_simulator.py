"""The trace simulator and the synthetic traces: FCFS, growth, preemption and the accounting."""

import numpy as np
import pytest

from pagedllm.reference.sim.simulator import PARTS, PagedKV, Simulator, make_kv, simulate
from pagedllm.reference.sim.traces import ALPACA, SHAREGPT, Request, synthetic_trace


def test_fcfs_head_of_line_blocking_by_hand():
    """Oracle, 10 slots: A (2+3) runs; B (4+2) does not fit and blocks C (1+1), which would."""
    trace = [Request(0, 0.0, 2, 3), Request(1, 0.0, 4, 2), Request(2, 0.0, 1, 1)]
    sim = Simulator(trace, make_kv("oracle", 10))
    sim.step()  # step 0: A admitted into [0, 5); a gap of 5 left, B needs 6
    assert [s.id for s in sim.running] == [0] and [s.id for s in sim.waiting] == [1, 2]
    parts = sim.kv.accounting(sim.waiting[0])
    assert (parts.token_states, parts.reserved, parts.internal, parts.external, parts.free) == (
        2, 3, 0, 5, 0)
    for _ in range(3):  # steps 1-3: A grows to 5 tokens and finishes
        sim.step()
    assert sim.running == [] and sim.finished == 1
    result = sim.run()  # step 4: B and C admitted; C done after step 5, B after step 6
    assert (result.steps, result.finished, result.preemptions) == (7, 3, 0)
    assert result.measured_steps == 4  # steps 0-3, while B waited
    assert result.mean_running == 1.0
    # token states 2, 3, 4, 5 and reserved 3, 2, 1, 0 of 10 slots; the gap of 5 is external
    assert result.shares == pytest.approx({"token_states": 0.35, "reserved": 0.15,
                                           "internal": 0.0, "external": 0.5, "free": 0.0})


def test_paged_preempts_the_latest_arrival_and_recomputes_it():
    """4 blocks of 2: A and B (3+4 each) fill the pool; when A needs a block, B is evicted."""
    trace = [Request(0, 0.0, 3, 4), Request(1, 0.0, 3, 4)]
    kv = PagedKV(total_slots=8, block_size=2, watermark=0.0)
    sim = Simulator(trace, kv)
    sim.step()  # both admitted with 2 blocks each
    sim.step()  # both grow into the free slot of their second block
    assert [kv.manager.num_tokens(i) for i in (0, 1)] == [4, 4]
    sim.step()  # A needs a third block: B (latest arrival) is preempted, no admission
    assert sim.preemptions == 1 and [s.id for s in sim.waiting] == [1]
    assert sim.waiting[0].generated == 1  # B keeps its progress: it is prefilled with 4 tokens
    assert kv.manager.num_tokens(0) == 5
    result = sim.run()
    assert result.finished == 2
    assert kv.manager.num_seqs == 0 and kv.manager.num_free_gpu_blocks == 4  # nothing leaked


def test_paged_accounting_has_no_reserved_and_no_external():
    kv = PagedKV(total_slots=100, block_size=16, watermark=0.0)  # 6 blocks, 4 slots left over
    sim = Simulator([Request(0, 0.0, 20, 5), Request(1, 0.0, 3, 5)], kv)
    sim.step()
    parts = kv.accounting(None)
    assert parts.token_states == 23
    assert parts.internal == 3 * 16 - 23  # the empty tail slots of the last blocks
    assert (parts.reserved, parts.external) == (0, 0)
    assert parts.free == 100 - 3 * 16 and parts.total == 100


@pytest.fixture(scope="module")
def small_sharegpt():
    return synthetic_trace("sharegpt", 150, rate=1.0, seed=3)


@pytest.mark.parametrize("allocator", ["max", "pow2", "oracle", "paged"])
def test_shares_sum_to_one_and_everything_finishes(small_sharegpt, allocator):
    result = simulate(small_sharegpt, allocator, total_slots=15_728)
    assert result.finished == len(small_sharegpt)
    assert sum(result.shares.values()) == pytest.approx(1.0)
    assert min(result.shares.values()) >= 0 and set(result.shares) == set(PARTS)
    assert 0 < result.measured_steps < result.steps  # not measured: the drain at the end
    if allocator != "paged":
        assert result.preemptions == 0  # a slab holds every token its request will have
    if allocator == "max":
        assert result.mean_running <= 15_728 // 2048  # seven 2048-slot slabs at most
        assert result.shares["external"] == pytest.approx(1392 / 15_728, abs=0.01)


def test_paged_keeps_more_in_token_states_than_every_contiguous_policy(small_sharegpt):
    share = {a: simulate(small_sharegpt, a, 15_728).shares["token_states"]
             for a in ("max", "pow2", "oracle", "paged")}
    assert share["max"] < share["pow2"] < share["oracle"] < share["paged"]
    assert share["paged"] > 0.9


def test_measure_all_counts_idle_memory_as_free():
    trace = synthetic_trace("alpaca", 50, rate=0.01, seed=0)  # light load: nobody ever waits
    waiting = simulate(trace, "oracle", 15_728)
    everything = simulate(trace, "oracle", 15_728, measure="all")
    assert waiting.measured_steps == 0
    assert everything.measured_steps > 0 and everything.shares["free"] > 0.9


def test_bad_input():
    with pytest.raises(ValueError, match="unknown reservation policy 'best'"):
        make_kv("best", 1000)
    with pytest.raises(ValueError, match="more than the KV budget of 1000"):
        Simulator([Request(0, 0.0, 10, 10)], make_kv("max", 1000))  # 2048-slot slab
    with pytest.raises(ValueError, match="more than the pool of 62"):
        Simulator([Request(0, 0.0, 1000, 1000)], make_kv("paged", 1000))
    with pytest.raises(ValueError, match="holds no block of 16"):
        PagedKV(total_slots=8, block_size=16)
    with pytest.raises(ValueError, match="measure must be 'waiting' or 'all'"):
        Simulator([], make_kv("oracle", 100), measure="sometimes")


# -- traces -------------------------------------------------------------------------------

def test_traces_are_seeded_and_clipped():
    a = synthetic_trace("sharegpt", 500, rate=2.0, seed=7)
    assert a == synthetic_trace("sharegpt", 500, rate=2.0, seed=7)
    assert a != synthetic_trace("sharegpt", 500, rate=2.0, seed=8)
    assert all(r.prompt_len >= 1 and r.output_len >= 1 for r in a)
    assert all(r.prompt_len + r.output_len <= 2048 for r in a)
    assert all(r.prompt_len + r.output_len <= 256 for r in synthetic_trace("sharegpt", 200, 1.0,
                                                                           max_len=256))
    arrivals = [r.arrival for r in a]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0


def test_traces_match_the_published_means_and_poisson_rate():
    for model in (SHAREGPT, ALPACA):
        trace = synthetic_trace(model, 40_000, rate=4.0, seed=1)
        prompts = np.array([r.prompt_len for r in trace])
        outputs = np.array([r.output_len for r in trace])
        assert prompts.mean() == pytest.approx(model.prompt_mean, rel=0.03)
        assert outputs.mean() == pytest.approx(model.output_mean, rel=0.03)
        gaps = np.diff([r.arrival for r in trace])
        assert gaps.mean() == pytest.approx(1 / 4.0, rel=0.03)  # exponential gaps, mean 1/rate
        assert gaps.std() == pytest.approx(1 / 4.0, rel=0.05)  # ... and std 1/rate
    share = synthetic_trace(SHAREGPT, 5000, 1.0, seed=2)
    alpaca = synthetic_trace(ALPACA, 5000, 1.0, seed=2)
    assert np.std([r.output_len for r in share]) > 4 * np.std([r.output_len for r in alpaca])


def test_trace_bad_input():
    with pytest.raises(ValueError, match="rate must be > 0"):
        synthetic_trace("alpaca", 10, rate=0)
    with pytest.raises(ValueError, match="num_requests must be >= 1"):
        synthetic_trace("alpaca", 0, rate=1)
    with pytest.raises(KeyError):
        synthetic_trace("dolly", 10, rate=1)


def test_memory_map_figure_tiles_the_whole_space(monkeypatch):
    """The lesson's figure draws every slot exactly once, in the part the accounting says."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "lessons" / "figures" / "memory_map.py"
    monkeypatch.syspath_prepend(str(script.parent))  # as when run: its folder's figlang.py
    spec = importlib.util.spec_from_file_location("memory_map", script)
    memory_map = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(memory_map)
    for allocator in ("pow2", "paged"):
        segments, shares, _ = memory_map.snapshot(allocator, step=60, total_slots=4000, seed=1)
        covered = sorted((start, length) for start, length, _ in segments if length)
        cursor = 0
        for start, length in covered:  # no overlap, no hole
            assert start == cursor
            cursor += length
        assert cursor == 4000  # 250 blocks of 16 for paged: no slot left over
        for part, share in shares.items():
            drawn = sum(n for _, n, p in segments if p == part)
            assert drawn == round(share * 4000), (allocator, part)
