"""Checks lesson 9's exercise: chained keys, the prefix lookup and LRU eviction.

    pytest lessons/exercises/test_prefix_cache_exercise.py

Each test runs twice: against the solution (always) and against your file,
lessons/exercises/prefix_cache_exercise.py (skipped while the function it needs still raises
NotImplementedError). conftest.py loads both by file path, so lessons/ needs no __init__.py.

The reference is BlockSpaceManager (reference/kv/block_manager.py) with prefix caching on. An
admission is allocate(...) with the prompt's token ids followed by mark_computed(...) for the
whole prompt (its prefill ran); a free is free(...). The streams mix a few shared system
prompts with private suffixes, repeat whole prompts, and free requests in random order, in
pools small enough that cached blocks are evicted.
"""

import random

import pytest

from pagedllm.reference.kv.block_manager import BlockSpaceManager

EXERCISE = "prefix_cache_exercise"  # impl (conftest.py): the solution's file, then yours

PROBES = {"chain_keys": ([1], 1), "replay": ([], 1, 1)}


def use(impl, function: str):
    """The function, or a skip while the learner's version still raises NotImplementedError."""
    return impl.use(function, *PROBES[function])


def lesson_session():
    """The session of lesson 9: A, B, both freed, C (evicts A's deepest block), A again."""
    system = list(range(100, 108))
    a, b, c = system + [1, 2, 3, 4, 5], system + [9, 9, 9], [7] * 27
    return [("admit", "A", a), ("admit", "B", b), ("free", "A"), ("free", "B"),
            ("admit", "C", c), ("free", "C"), ("admit", "A2", a)]


def real_replay(events, num_blocks: int, block_size: int):
    """The manager's block tables, cached tokens and keys, one per admission."""
    manager = BlockSpaceManager(block_size, num_blocks, enable_prefix_caching=True)
    ids, results = {}, []
    for event in events:
        if event[0] == "free":
            manager.free(ids.pop(event[1]))
            continue
        _, request_id, tokens = event
        ids[request_id] = seq_id = len(results)
        manager.allocate(seq_id, len(tokens), tokens)
        manager.mark_computed(seq_id, tokens, len(tokens))
        table = manager.tables[seq_id]
        results.append((list(table.blocks), table.num_cached_tokens, list(table.keys)))
    return results


def random_events(seed: int, num_blocks: int, block_size: int):
    rng = random.Random(seed)
    manager = BlockSpaceManager(block_size, num_blocks, enable_prefix_caching=True)
    systems = [[rng.randrange(50) for _ in range(rng.randint(1, 3) * block_size
                                                 + rng.choice([0, 0, 1]))] for _ in range(3)]
    events, live, seen_prompts = [], [], []
    for i in range(120):
        if live and (rng.random() < 0.45 or len(live) > 4):
            request_id = live.pop(rng.randrange(len(live)))
            manager.free(request_id)
            events.append(("free", request_id))
            continue
        if seen_prompts and rng.random() < 0.2:
            tokens = list(rng.choice(seen_prompts))  # a prompt seen before, whole
        else:
            tokens = rng.choice(systems) + [rng.randrange(50)
                                            for _ in range(rng.randint(0, 2 * block_size))]
            tokens = tokens or [1]
        if not manager.can_allocate(len(tokens), tokens):
            continue
        manager.allocate(i, len(tokens), tokens)
        manager.mark_computed(i, tokens, len(tokens))
        events.append(("admit", i, tokens))
        live.append(i)
        seen_prompts.append(tokens)
    return events


def check(replay, events, num_blocks: int, block_size: int) -> list:
    expected = real_replay(events, num_blocks, block_size)
    got = replay(events, num_blocks, block_size)
    assert len(got) == len(expected), (
        f"{len(got)} results for {len(expected)} admissions: one (block table, cached tokens) "
        "per admission"
        f"\n받아들이기 {len(expected)}번에 결과 {len(got)}개: 받아들일 때마다 (블록 테이블, "
        "캐시된 토큰) 하나씩")
    admits = [e for e in events if e[0] == "admit"]
    for n, (mine, real, event) in enumerate(zip(got, expected, admits, strict=True)):
        blocks, cached, _ = real
        where = (f"admission {n} (request {event[1]!r}, {len(event[2])} tokens), pool of "
                 f"{num_blocks} blocks of {block_size}")
        assert mine[1] == cached, (
            f"{where}: you reuse {mine[1]} cached tokens, the manager {cached}"
            f"\n{where}: 재사용한 캐시된 토큰이 여러분은 {mine[1]}개, 관리자는 {cached}개")
        assert list(mine[0]) == blocks, (
            f"{where}: your block table {list(mine[0])}, the manager's {blocks}"
            f"\n{where}: 여러분의 블록 테이블 {list(mine[0])}, 관리자의 것 {blocks}")
    return expected


def test_chain_keys_match_the_manager(impl):
    chain_keys = use(impl, "chain_keys")
    for block_size in [1, 4, 16]:
        for seed in range(3):
            events = random_events(seed, 40, block_size)
            for (_, _, keys), (_, _, tokens) in zip(real_replay(events, 40, block_size),
                                                    [e for e in events if e[0] == "admit"],
                                                    strict=True):
                assert chain_keys(tokens, block_size) == keys, (
                    f"keys of {tokens} in blocks of {block_size}: yours differ from the "
                    "manager's (block 0's parent is None; block i's parent is key i - 1)"
                    f"\n{block_size}칸 블록에 담긴 {tokens}의 키: 여러분의 키가 관리자의 것과 "
                    "다릅니다(블록 0의 부모는 None, 블록 i의 부모는 키 i - 1)")


def test_chain_keys_name_the_whole_prefix(impl):
    chain_keys = use(impl, "chain_keys")
    a, b = chain_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4), chain_keys([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2, (f"9 tokens in blocks of 4: 2 full blocks, so 2 keys, got {len(a)}"
                         f"\n4칸 블록에 9토큰: 가득 찬 블록 2개이므로 키 2개, 결과 {len(a)}개")
    assert a[1] != b[1], ("block 1 holds the same tokens, but after a different block 0"
                          "\n블록 1은 같은 토큰을 담지만, 앞의 블록 0이 다릅니다")
    assert chain_keys([1, 2, 3], 4) == [], ("a partly filled block has no key"
                                            "\n일부만 찬 블록에는 키가 없습니다")


def test_the_lesson_session(impl):
    replay = use(impl, "replay")
    got = replay(lesson_session(), 10, 4)
    want = [([0, 1, 2, 3], 0), ([0, 1, 4], 8), ([5, 6, 7, 8, 9, 3, 2], 0), ([0, 1, 4, 2], 8)]
    for mine, (blocks, cached), who in zip(got, want, ["A", "B", "C", "A again"], strict=True):
        assert (list(mine[0]), mine[1]) == (blocks, cached), (
            f"{who}: got {mine}, lesson 9's session gives {(blocks, cached)}"
            f"\n{who}: 결과 {mine}, 9강의 세션이 주는 값 {(blocks, cached)}")
    check(replay, lesson_session(), 10, 4)


def test_a_prompt_found_whole_computes_its_last_block(impl):
    replay = use(impl, "replay")
    prompt = list(range(8))
    got = replay([("admit", "A", prompt), ("free", "A"), ("admit", "B", prompt)], 6, 4)
    assert got[1][1] == 4, (
        f"got {got[1]}: an 8-token prompt of 2 full blocks reuses only block 0; the block "
        "holding its last token is computed again"
        f"\n결과 {got[1]}: 가득 찬 블록 2개로 된 8토큰 프롬프트는 블록 0만 재사용합니다. 마지막 "
        "토큰을 담은 블록은 다시 계산합니다")
    check(replay, [("admit", "A", prompt), ("free", "A"), ("admit", "B", prompt)], 6, 4)


@pytest.mark.parametrize("num_blocks, block_size", [(12, 4), (20, 4), (30, 2), (8, 16),
                                                    (40, 1), (16, 3)])
def test_matches_the_manager(impl, num_blocks, block_size):
    replay = use(impl, "replay")
    hits = 0
    for seed in range(4):
        events = random_events(seed, num_blocks, block_size)
        hits += sum(cached > 0 for _, cached, _ in check(replay, events, num_blocks, block_size))
    assert hits >= 5, (f"the test's streams found too few cached prefixes ({hits})"
                       f"\n테스트의 스트림이 찾은 캐시된 프리픽스가 너무 적습니다({hits})")
