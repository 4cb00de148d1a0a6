"""Milestone 7, the engine: the track's pieces run the shipped tiny model and must produce
exactly pagedllm's greedy tokens on a fixed workload.

    pytest lessons/build/test_build_engine.py

On the solution side every piece is the solution's: that run is the track's own end-to-end
check. On your side the engine is lessons/build/engine.py (skipped until step is written) and
every other piece is yours once written (the summary at the end says which). The KV pool is
filled with NaN before the run: reading a slot that nothing wrote spoils the tokens.
"""

import pytest
from build_track import MAX_TOKENS, EngineConfig, differences, pagedllm_tokens, workload_prompts

from pagedllm.reference import load_model
from pagedllm.serving.default_model import default_model_dir

PIECE = "engine"
PREFIX_CACHING = True  # the block manager must take a prefix cache
CONFIGS = {
    # Six requests, four running at most, 16 blocks of 4 slots: requests wait and running
    # ones are preempted; three prompts share their first 18 tokens (4 full blocks: hits).
    "prefix-caching": EngineConfig(),
    # The fewest blocks add_request accepts for the longest request (25 + 24 tokens, 13
    # blocks), six running at most: more preemption.
    "smallest-pool": EngineConfig(num_blocks=13, max_num_seqs=6, enable_prefix_caching=False),
}


@pytest.fixture(scope="module")
def model(one_thread):
    return load_model(default_model_dir())


@pytest.fixture(scope="module")
def prompts():
    return workload_prompts()


@pytest.fixture(scope="module")
def expected(prompts, one_thread):
    return {name: pagedllm_tokens(prompts, MAX_TOKENS, config)
            for name, config in CONFIGS.items()}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_engine_generates_pagedllms_tokens(impl, parts, model, prompts, expected, name):
    config = CONFIGS[name]
    engine = impl.MiniEngine(model, parts, **config.kwargs())
    for cache in (*engine.k_caches, *engine.v_caches):
        cache.fill_(float("nan"))
    seqs = [engine.add_request(p, MAX_TOKENS) for p in prompts]
    preempted = cache_hits = steps = 0
    while engine.scheduler.has_unfinished():
        assert steps < 1000, ("the engine does not finish the workload"
                              "\n엔진이 워크로드를 끝내지 못합니다")
        out = engine.step()
        steps += 1
        preempted += len(out.preempted)
        # A prefill that starts past position 0 was given its first tokens by the cache.
        cache_hits += sum(1 for item in out.scheduled if item.num_tokens > 1
                          and item.seq.num_computed_tokens > item.num_tokens)
    used = ", ".join(f"{piece} {origin}" for piece, origin in parts.origin.items())
    wrong = differences([s.output_token_ids for s in seqs], expected[name], prompts)
    assert wrong is None, (f"{wrong}\n(the pieces: {used})"
                           f"\n(조각: {used})")
    assert preempted > 0, (f"no request was preempted: the pool is meant to force it ({used})"
                           "\n선점된 요청이 없습니다: 이 풀은 선점이 일어나도록 정한 "
                           f"것입니다({used})")
    if config.enable_prefix_caching:
        assert cache_hits > 0, ("no prefill found cached blocks although three prompts share "
                                f"18 tokens: does your block manager use the prefix cache? "
                                f"({used})"
                                "\n프롬프트 셋이 토큰 18개를 공유하는데도 캐시된 블록을 찾은 "
                                "프리필이 없습니다: 여러분의 블록 관리자가 프리픽스 캐시를 "
                                f"쓰나요? ({used})")
