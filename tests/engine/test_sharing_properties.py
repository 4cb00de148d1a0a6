"""Random workloads mixing parallel sampling, beam search and prefix caching, with preemption
forced by a small pool: same tokens as a roomy pool, no leaks, no count below zero, and no
physical block written while another sequence still holds it (checked before every write)."""

from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SHARED = list(range(200, 214))  # a common prefix some prompts start with

request = st.tuples(
    st.integers(1, 3),  # n
    st.integers(1, 18),  # prompt length after the optional shared prefix
    st.booleans(),  # starts with the shared prefix
    st.integers(2, 10),  # max_tokens
)


def write_guard(tier, path, block_size: int):
    """The backend the tier chooses for this model, with a store_kv that fails the moment a K/V
    row lands in a block that is shared or free (it reads the reference counts of the engine it
    is given to)."""
    base = tier.LLM(path, block_size=block_size).engine.backend
    store_kv = base.store_kv
    state = {}

    def checked_store_kv(k, v, k_cache, v_cache, slot_mapping):
        manager = state["engine"].kv.manager
        for slot in slot_mapping.tolist():
            count = manager.gpu.ref_counts[slot // block_size]
            assert count == 1, f"write into block {slot // block_size} held {count}x"
        store_kv(k, v, k_cache, v_cache, slot_mapping)

    return replace(base, store_kv=checked_store_kv), state


def run_workload(tier, path, reqs, beams, **engine_args):
    backend, guard = write_guard(tier, path, block_size=4)
    llm = tier.LLM(path, block_size=4, backend=backend, **engine_args)
    guard["engine"] = llm.engine
    prompts = [{"prompt_token_ids": (SHARED if shared else []) + [(7 * i + j) % 250
                                                                   for j in range(length)]}
               for i, (_, length, shared, _) in enumerate(reqs)]
    params = [tier.SamplingParams(n=n, temperature=0.9, seed=i, max_tokens=m, ignore_eos=True)
              for i, (n, _, _, m) in enumerate(reqs)]
    outs = [[c.token_ids for c in sorted(o.outputs, key=lambda c: c.index)]
            for o in llm.generate(prompts, params, use_tqdm=False)]
    beam_params = [tier.BeamSearchParams(beam_width=w, max_tokens=4, ignore_eos=True)
                   for w in beams]
    beam_outs = [[s.tokens for s in llm.beam_search(prompts[i % len(prompts)], bp)[0].sequences]
                 for i, bp in enumerate(beam_params)]
    manager = llm.engine.kv.manager
    assert all(c >= 0 for c in manager.gpu.ref_counts + manager.cpu.ref_counts)
    assert manager.num_free_gpu_blocks == manager.gpu.num_blocks and manager.num_seqs == 0
    assert manager.num_free_cpu_blocks == manager.cpu.num_blocks
    return outs, beam_outs, llm.stats()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.function_scoped_fixture])
@given(reqs=st.lists(request, min_size=2, max_size=6),
       beams=st.lists(st.integers(1, 3), max_size=2),
       mode=st.sampled_from(["recompute", "swap"]), caching=st.booleans())
def test_mixed_sharing_under_pressure(tier, checkpoints, reqs, beams, mode, caching):
    path = checkpoints["llama3"]
    roomy = run_workload(tier, path, reqs, beams)
    # the largest request must still fit: n copies of (prompt + output) in 4-token blocks
    worst = max(n * -(-(len(SHARED) + length + m) // 4) for n, length, _, m in reqs)
    tight = run_workload(tier, path, reqs, beams, num_gpu_blocks=max(worst, 18),
                         preemption_mode=mode, swap_space_blocks=200,
                         enable_prefix_caching=caching)
    assert tight[0] == roomy[0] and tight[1] == roomy[1]


def test_a_fixed_mixed_workload_really_preempts(tier, checkpoints):
    """The pressure the property test relies on, shown on one workload in both modes."""
    path = checkpoints["llama3"]
    reqs = [(3, 18, True, 10), (2, 15, True, 10), (3, 10, False, 9), (1, 12, True, 8)]
    roomy = run_workload(tier, path, reqs, [2])
    for mode in ("recompute", "swap"):
        tight = run_workload(tier, path, reqs, [2], num_gpu_blocks=33, preemption_mode=mode,
                             swap_space_blocks=200, enable_prefix_caching=True)
        assert tight[:2] == roomy[:2]
        assert tight[2]["preemptions_recompute"] + tight[2]["preemptions_swap"] > 0
