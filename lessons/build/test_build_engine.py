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
from build_types import RUNNING, Sequence

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


# -- n > 1: a request forks after its prefill (parallel sampling), and copy-on-write ---------
# The short prompts (2, 9 and 5 tokens) each end in a partly filled block of 4 slots. Each
# request asks for two samples: after the step that prefills it, a second sequence forks from
# it, as vLLM's parallel sampling does (BlockManager.fork: the blocks are shared, ref count 2).
# The next decode writes into the shared last block, so the block manager hands one of the two
# a copy (append_slot's (src, dst)), and the step must carry the copy out before the forward:
# a copy left undone leaves the prompt's K/V in that block NaN. Both samples are greedy, so
# each must give pagedllm's tokens for its prompt.
FORK_PROMPTS = slice(3, 6)
FORK_CONFIG = EngineConfig(num_blocks=32, max_num_seqs=6, enable_prefix_caching=False)
FORK_MAX_TOKENS = 8


def fork(engine, parent: Sequence, child_id: int) -> Sequence:
    """A second sample of parent's request: its tokens, its blocks shared, running."""
    child = Sequence(child_id, list(parent.prompt_token_ids), parent.max_tokens, parent.arrival,
                     output_token_ids=list(parent.output_token_ids),
                     num_computed_tokens=parent.num_computed_tokens, status=RUNNING)
    engine.block_manager.fork(parent.seq_id, child.seq_id)
    engine.scheduler.running.append(child)
    return child


@pytest.fixture(scope="module")
def fork_expected(prompts, one_thread):
    return pagedllm_tokens(prompts[FORK_PROMPTS], FORK_MAX_TOKENS, FORK_CONFIG)


def test_two_samples_per_request_need_the_block_copies(impl, parts, model, prompts,
                                                       fork_expected):
    engine = impl.MiniEngine(model, parts, **FORK_CONFIG.kwargs())
    for cache in (*engine.k_caches, *engine.v_caches):
        cache.fill_(float("nan"))
    parents = [engine.add_request(p, FORK_MAX_TOKENS) for p in prompts[FORK_PROMPTS]]
    children: dict[int, Sequence] = {}
    copies = steps = 0
    while engine.scheduler.has_unfinished():
        assert steps < 200, ("the engine does not finish the workload"
                             "\n엔진이 워크로드를 끝내지 못합니다")
        out = engine.step()
        steps += 1
        copies += len(out.blocks_to_copy)
        for i, parent in enumerate(parents):  # fork each request once its prefill has sampled
            if i not in children and parent.output_token_ids and not parent.is_finished:
                children[i] = fork(engine, parent, 1000 + i)
    used = ", ".join(f"{piece} {origin}" for piece, origin in parts.origin.items())
    assert len(children) == len(parents), "a request finished before it could fork"
    for i, parent in enumerate(parents):
        for who, seq in (("sample 0", parent), ("sample 1 (forked)", children[i])):
            wrong = differences([seq.output_token_ids], [fork_expected[i]],
                                [prompts[FORK_PROMPTS][i]])
            assert wrong is None, (
                f"{who} of the {len(seq.prompt_token_ids)}-token prompt: {wrong}\n"
                "did the step carry out out.blocks_to_copy (parts.copy_blocks) before the "
                f"forward? ({used})\n{who}: 스텝이 forward 전에 out.blocks_to_copy를 "
                f"(parts.copy_blocks로) 수행했나요? ({used})")
    assert copies > 0, (f"no block was copied on write: the forks are meant to force it ({used})"
                        "\n쓰기 시 복사된 블록이 없습니다: 포크는 복사가 일어나도록 정한 "
                        f"것입니다({used})")
