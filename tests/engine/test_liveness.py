"""Every accepted request finishes; an exception inside a step never bricks the engine.

The property test draws random pools, budgets, block sizes, preemption modes and request mixes
(parallel samples, beam searches, shared prefixes, lengths). Whatever the engine accepts must
finish within a bound on the number of steps computed from the requests' sizes, and leave no
block behind; what it refuses must be refused at add_request with a ValueError.
"""


import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pagedllm.reference import LLM, BeamSearchParams, SamplingParams

from ..conftest import failing_backend

SHARED = list(range(100, 111))

request = st.tuples(
    st.sampled_from(["sample", "beam"]),
    st.integers(1, 3),  # n or beam width
    st.integers(1, 24),  # prompt length
    st.booleans(),  # starts with the shared prefix
    st.integers(1, 16),  # max_tokens
)
engine_args = st.fixed_dictionaries({
    "block_size": st.sampled_from([1, 2, 4, 8]),
    "num_gpu_blocks": st.integers(6, 48),
    "max_num_seqs": st.integers(2, 8),
    "preemption_mode": st.sampled_from(["recompute", "swap"]),
    "swap_space_blocks": st.sampled_from([0, 4, 64]),
    "enable_prefix_caching": st.booleans(),
    "enable_chunked_prefill": st.booleans(),
    "max_num_batched_tokens": st.sampled_from([None, 1, 3, 8, 64]),
})


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(args=engine_args, reqs=st.lists(request, min_size=3, max_size=8))
def test_every_accepted_request_finishes(checkpoints, args, reqs):
    args = dict(args)
    if not args["enable_chunked_prefill"]:
        args["max_num_batched_tokens"] = None  # the default: a whole prompt fits one step
    try:
        llm = LLM(checkpoints["llama"], max_model_len=64, **args)
    except ValueError:
        return  # refused at construction: nothing accepted
    engine, accepted, work = llm.engine, [], 0
    for i, (kind, width, length, shared, max_tokens) in enumerate(reqs):
        prompt = (SHARED if shared else []) + [(5 * i + j) % 200 for j in range(length)]
        params = (BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True)
                  if kind == "beam" else
                  SamplingParams(n=width, temperature=0.8, seed=i, max_tokens=max_tokens,
                                 ignore_eos=True))
        try:
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
        except ValueError:
            continue  # refused at the door, with a reason
        accepted.append(str(i))
        work += width * (len(prompt) + max_tokens)
    event(f"accepted {len(accepted)} of {len(reqs)}")
    finished, steps = set(), 0
    bound = 50 + 20 * work  # generous: preemption recomputes, a hang never ends
    while engine.has_unfinished_requests():
        steps += 1
        assert steps <= bound, f"not finished after {bound} steps: {llm.stats()}"
        finished |= {out.request_id for out in engine.step() if out.finished}
    assert finished == set(accepted)
    stats, manager = llm.stats(), engine.kv.manager
    event(f"preempted: {stats['preemptions_recompute'] + stats['preemptions_swap'] > 0}")
    assert stats["blocks_used"] == 0 and stats["swapped_blocks"] == 0 and manager.num_seqs == 0
    assert all(c == 0 for c in manager.gpu.ref_counts + manager.cpu.ref_counts)


def test_requests_that_could_never_be_scheduled_are_refused(checkpoints):
    path = checkpoints["llama"]
    with pytest.raises(ValueError, match="more than max_num_seqs = 2"):
        LLM(path, max_num_seqs=2).generate({"prompt_token_ids": [1]}, SamplingParams(n=3))
    with pytest.raises(ValueError, match="more than max_num_batched_tokens = 2"):
        LLM(path, enable_chunked_prefill=True, max_num_batched_tokens=2).beam_search(
            {"prompt_token_ids": [1]}, BeamSearchParams(beam_width=3, max_tokens=2))
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= 1"):
        LLM(path, enable_chunked_prefill=True, max_num_batched_tokens=0)


def test_a_swapped_parallel_group_asks_only_for_what_it_needs():
    """Three samples whose last blocks still have room, swapped out of a pool that holds
    exactly their blocks: swap-in needs no spare block, so an empty pool takes them back (it
    used to ask for one spare per sample, more than the pool could ever free)."""
    from pagedllm.reference.engine.sequence import Sequence, SequenceGroup
    from pagedllm.reference.kv import PagedKVCacheManager

    kv = PagedKVCacheManager(block_size=4, num_gpu_blocks=7, num_cpu_blocks=16)
    seqs = [Sequence(i, list(range(8)), [1, 2]) for i in range(3)]  # 8 + 2 tokens each
    group = SequenceGroup("r", seqs, SamplingParams(n=3), arrival=0, seed=0)
    kv.manager.allocate(0, 8)  # 2 full prompt blocks, shared by all three samples
    for seq in seqs[1:]:
        kv.fork(seqs[0], seq)
    for seq in seqs:  # each sample writes its own third block: 2 + 3 = 5 blocks
        seq.num_computed_tokens = 8
        kv.allocate_slots(seq, num_new_tokens=2)
    assert kv.num_free_blocks == 2
    kv.swap_out(group)
    assert kv.num_free_blocks == 7 and kv.can_swap_in(group)  # 5 blocks, no spare needed
    kv.swap_in(group)
    assert kv.num_free_blocks == 2


@pytest.mark.parametrize("op, after, kv_cache_dtype", [
    ("paged_attention", 7, "auto"), ("sample", 3, "auto"), ("copy_blocks", 1, "auto"),
    ("swap_blocks", 1, "auto"), ("store_kv", 5, "int4"), ("copy_blocks", 1, "int8"),
    ("swap_blocks", 1, "fp8")])
def test_a_failing_step_leaves_the_engine_usable(checkpoints, op, after, kv_cache_dtype):
    path = checkpoints["llama"]
    kwargs = dict(block_size=2, num_gpu_blocks=24, preemption_mode="swap",
                  swap_space_blocks=64, kv_cache_dtype=kv_cache_dtype)
    llm = LLM(path, backend=failing_backend(op, after), **kwargs)
    prompts = [{"prompt_token_ids": list(range(3 + i, 12 + i))} for i in range(3)]
    params = SamplingParams(n=2, temperature=0.9, seed=1, max_tokens=8, ignore_eos=True)
    with pytest.raises(RuntimeError, match="injected failure"):
        llm.generate(prompts, params, use_tqdm=False)
    stats = llm.stats()
    assert stats["blocks_used"] == 0 and stats["swapped_blocks"] == 0
    assert not llm.engine.has_unfinished_requests() and not llm.engine.groups
    again = llm.generate(prompts, params, use_tqdm=False)  # works, and as a fresh engine does
    fresh = LLM(path, **kwargs).generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in again] == [
        [c.token_ids for c in o.outputs] for o in fresh]
    assert llm.stats()["blocks_used"] == 0


def test_an_observer_failure_finishes_the_step_requests_with_an_error(checkpoints):
    llm = LLM(checkpoints["llama"], block_size=4)
    engine = llm.engine
    engine.add_request("a", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4))

    def boom(engine, sched, inputs):
        raise KeyError("observer")

    engine.add_step_observer(boom)
    with pytest.raises(KeyError):
        engine.step()
    engine.step_observers.clear()
    assert "a" not in engine.groups and not engine.has_unfinished_requests()
    assert llm.stats()["blocks_used"] == 0
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
