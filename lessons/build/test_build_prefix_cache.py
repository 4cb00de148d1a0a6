"""Milestone 4, prefix caching: chained keys, the longest cached run, sharing a held block,
taking back a freed one, forgetting a block handed out again, and what goes first.

    pytest lessons/build/test_build_prefix_cache.py

Each test runs on the solution and on lessons/build/prefix_cache.py (skipped until written).
The block manager and the scheduler are milestones 2-3's: yours once written. Your block
manager must also use the prefix cache (milestone 4's part of block_manager.py).
"""

from build_types import Sequence

PIECE = "prefix_cache"
PREFIX_CACHING = True  # the block manager must take a prefix cache
BS = 4


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def computed(bm, seq_id: int, token_ids: list[int]) -> None:
    """Allocate a sequence and mark all its tokens computed, as after its prefill."""
    bm.allocate(seq_id, len(token_ids), token_ids)
    bm.mark_computed(seq_id, token_ids, len(token_ids))


def test_keys_name_the_whole_prefix(impl):
    key = impl.PrefixCache.key
    a = key(None, [1, 2, 3, 4])
    assert isinstance(a, str) and a == key(None, [1, 2, 3, 4]), (
        "a key depends on content only"
        "\n키는 내용에만 달려 있습니다")
    assert key(None, [1, 2, 3, 5]) != a
    b = key(a, [5, 6, 7, 8])
    assert b != key(None, [5, 6, 7, 8]), ("the same tokens after a different prefix hold "
                                          "different K/V: the parent's key must change the key"
                                          "\n같은 토큰이라도 프리픽스가 다르면 K/V가 다릅니다: "
                                          "부모의 키가 달라지면 키도 달라져야 합니다")
    assert b != key(key(None, [9, 9, 9, 9]), [5, 6, 7, 8])


def test_lookup_finds_the_longest_run(impl):
    cache = impl.PrefixCache(BS)
    t = tokens(0, 13)
    keys = [None]
    for i in range(3):
        keys.append(cache.key(keys[-1], t[i * BS:(i + 1) * BS]))
        cache.register(keys[-1], 10 + i)
    assert cache.lookup(t) == [(keys[1], 10), (keys[2], 11), (keys[3], 12)]
    assert cache.lookup(t[:12]) == [(keys[1], 10), (keys[2], 11)], (
        "12 tokens are 3 full blocks, but the last token is always computed (its logits pick "
        "the next token): the third block cannot come from the cache"
        "\n토큰 12개는 가득 찬 블록 3개이지만, 마지막 토큰은 항상 계산합니다(그 로짓이 다음 "
        "토큰을 고릅니다): 세 번째 블록은 캐시에서 올 수 없습니다")
    assert cache.lookup(t[:8] + [99] + t[9:]) == [(keys[1], 10), (keys[2], 11)]
    assert cache.lookup([99] + t[1:]) == [], ("the first block differs: nothing matches"
                                              "\n첫 블록이 다릅니다: 일치하는 것이 없습니다")
    cache.evict(11)
    assert cache.lookup(t) == [(keys[1], 10)], ("block 11 was evicted: the run stops there, "
                                                "even though block 12 is still registered"
                                                "\n블록 11이 축출되었습니다: 블록 12가 아직 "
                                                "등록되어 있어도 연속 일치는 거기서 멈춥니다")
    cache.evict(5)  # never registered: nothing happens


def test_the_first_registration_stays(impl):
    cache = impl.PrefixCache(BS)
    k = cache.key(None, tokens(0, 4))
    cache.register(k, 3)
    cache.register(k, 5)  # the same content computed again, elsewhere
    assert cache.lookup(tokens(0, 5)) == [(k, 3)]
    other = cache.key(None, tokens(50, 4))
    cache.register(other, 3)  # block 3 holds k's content: it cannot also hold other's
    assert cache.lookup(tokens(50, 5)) == []


def test_a_held_block_is_shared(impl, parts):
    bm = parts.BlockManager(5, BS, impl.PrefixCache(BS))
    a = tokens(0, 10)
    computed(bm, 0, a)  # 3 blocks, two of them full and registered; 2 free
    b = a[:8] + [77, 78, 79, 80, 81]  # 13 tokens: 4 blocks, the first two cached
    assert bm.can_allocate(len(b), b), (
        "sequence 1 needs 4 blocks and 2 are free, but its first 2 are cached blocks "
        "sequence 0 holds: sharing them costs no free block (the pool is one block too "
        "small without prefix caching; milestone 4's part of block_manager.py)"
        "\n시퀀스 1에는 블록 4개가 필요하고 빈 블록은 2개이지만, 앞의 2개는 시퀀스 0이 가진 "
        "캐시된 블록입니다: 그 블록을 공유하는 데는 빈 블록이 들지 않습니다(프리픽스 캐싱이 "
        "없으면 풀이 블록 하나만큼 모자랍니다. block_manager.py의 마일스톤 4 부분)")
    table = bm.allocate(1, len(b), b)
    assert table[:2] == bm.block_table(0)[:2], (
        "your block manager did not reuse the cached blocks: allocate must look the tokens "
        "up in its prefix cache (milestone 4's part of block_manager.py)"
        "\n여러분의 블록 관리자가 캐시된 블록을 재사용하지 않았습니다: allocate는 프리픽스 "
        "캐시에서 토큰을 조회해야 합니다(block_manager.py의 마일스톤 4 부분)")
    assert bm.num_cached_tokens(1) == 8 and bm.num_cached_tokens(0) == 0
    assert [bm.ref_count(x) for x in table[:2]] == [2, 2] and bm.num_free_blocks == 0


def test_only_computed_full_blocks_are_found(impl, parts):
    bm = parts.BlockManager(8, BS, impl.PrefixCache(BS))
    a = tokens(0, 10)
    bm.allocate(0, 10, a)
    bm.mark_computed(0, a, 6)  # K/V of 6 tokens so far: one full block
    bm.allocate(1, 10, a)
    assert bm.num_cached_tokens(1) == 4, (
        f"{bm.num_cached_tokens(1)} cached tokens: only block 0 is full and computed; a "
        "block whose K/V are not all computed must not be found"
        f"\n캐시된 토큰 {bm.num_cached_tokens(1)}개: 가득 차고 계산까지 끝난 블록은 블록 "
        "0뿐입니다. K/V가 다 계산되지 않은 블록은 조회되면 안 됩니다")


def test_a_freed_block_is_taken_back(impl, parts):
    bm = parts.BlockManager(6, BS, impl.PrefixCache(BS))
    a = tokens(0, 9)
    computed(bm, 0, a)
    held = bm.block_table(0)
    bm.free(0)
    assert bm.num_free_blocks == 6
    table = bm.allocate(1, 9, a)
    assert table[:2] == held[:2] and bm.num_cached_tokens(1) == 8, (
        "a freed block keeps its K/V: until it is handed out again, a lookup finds it"
        "\n해제된 블록도 K/V를 유지합니다: 다시 나눠 주기 전까지는 조회하면 찾을 수 있습니다")
    assert bm.num_free_blocks == 3 and all(bm.ref_count(x) == 1 for x in table), (
        "taking a cached block back takes it out of the free blocks"
        "\n캐시된 블록을 다시 가져오면 빈 블록에서 빠집니다")


def test_a_block_handed_out_again_is_forgotten(impl, parts):
    """A stale hit would read K/V that other tokens have overwritten."""
    bm = parts.BlockManager(3, BS, impl.PrefixCache(BS))
    a = tokens(0, 9)
    computed(bm, 0, a)  # all 3 blocks; the first two registered
    bm.free(0)
    computed(bm, 1, tokens(500, 12))  # takes every block, for other tokens
    bm.free(1)
    bm.allocate(2, 9, a)
    assert bm.num_cached_tokens(2) == 0, (
        "sequence 0's blocks were handed to sequence 1 and overwritten: the cache must "
        "forget them when they are handed out (evict), or sequence 2 reads wrong K/V"
        "\n시퀀스 0의 블록이 시퀀스 1에 나눠 주어져 덮어써졌습니다: 캐시는 블록을 나눠 줄 때 그 "
        "블록을 잊어야(축출) 합니다. 그렇지 않으면 시퀀스 2가 잘못된 K/V를 읽습니다")


def test_the_shared_prefix_goes_last(impl, parts):
    """Which free block goes out is the learner's design: only the outcome is checked."""
    bm = parts.BlockManager(6, BS, impl.PrefixCache(BS))
    a = tokens(0, 13)  # blocks: 3 full and registered, 1 partial
    computed(bm, 0, a)
    bm.free(0)
    bm.allocate(1, 16, tokens(500, 16))  # 4 of the 6 free blocks, for other tokens
    bm.free(1)
    bm.allocate(2, 13, a)
    assert bm.num_cached_tokens(2) == 8, (
        f"{bm.num_cached_tokens(2)} tokens found, 8 expected: the blocks your policy hands out "
        "must take a prompt's tail before its start, which more requests share (the "
        "solution: free a sequence's blocks last block first, hand out the least recently "
        "freed first)"
        f"\n찾은 토큰 {bm.num_cached_tokens(2)}개, 기대값 8개: 여러분의 정책은 더 많은 요청이 "
        "공유하는 프롬프트의 앞부분보다 끝부분을 먼저 내줘야 합니다(해답: 시퀀스의 블록은 마지막 "
        "블록부터 해제하고, 가장 오래전에 해제된 블록부터 나눠 줍니다)")


def test_the_scheduler_skips_cached_tokens(impl, parts):
    bm = parts.BlockManager(16, BS, impl.PrefixCache(BS))
    s = parts.Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    first = Sequence(0, tokens(0, 10), 2, 0)
    s.add(first)
    out = s.schedule()
    s.update(out, [7])
    second = Sequence(1, tokens(0, 8) + [90, 91, 92], 2, 1)
    s.add(second)
    out = s.schedule()
    got = [(item.seq.arrival, item.num_tokens) for item in out.scheduled]
    assert got == [(1, 3)], (
        f"scheduled {got}: sequence 1's first 8 tokens are cached, so its prefill computes "
        "3; the scheduler sets num_computed_tokens to the block manager's num_cached_tokens"
        f"\n스케줄 {got}: 시퀀스 1의 앞 토큰 8개가 캐시되어 있으므로 프리필은 3개를 계산합니다. "
        "스케줄러는 num_computed_tokens를 블록 관리자의 num_cached_tokens로 정합니다")
