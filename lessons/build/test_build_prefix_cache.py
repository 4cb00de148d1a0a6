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
    assert isinstance(a, str) and a == key(None, [1, 2, 3, 4]), "a key depends on content only"
    assert key(None, [1, 2, 3, 5]) != a
    b = key(a, [5, 6, 7, 8])
    assert b != key(None, [5, 6, 7, 8]), ("the same tokens after a different prefix hold "
                                          "different K/V: the parent's key must change the key")
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
        "the next token): the third block cannot come from the cache")
    assert cache.lookup(t[:8] + [99] + t[9:]) == [(keys[1], 10), (keys[2], 11)]
    assert cache.lookup([99] + t[1:]) == [], "the first block differs: nothing matches"
    cache.evict(11)
    assert cache.lookup(t) == [(keys[1], 10)], ("block 11 was evicted: the run stops there, "
                                                "even though block 12 is still registered")
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
        "small without prefix caching; milestone 4's part of block_manager.py)")
    table = bm.allocate(1, len(b), b)
    assert table[:2] == bm.block_table(0)[:2], (
        "your block manager did not reuse the cached blocks: allocate must look the tokens "
        "up in its prefix cache (milestone 4's part of block_manager.py)")
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
        "block whose K/V are not all computed must not be found")


def test_a_freed_block_is_taken_back(impl, parts):
    bm = parts.BlockManager(6, BS, impl.PrefixCache(BS))
    a = tokens(0, 9)
    computed(bm, 0, a)
    held = bm.block_table(0)
    bm.free(0)
    assert bm.num_free_blocks == 6
    table = bm.allocate(1, 9, a)
    assert table[:2] == held[:2] and bm.num_cached_tokens(1) == 8, \
        "a freed block keeps its K/V: until it is handed out again, a lookup finds it"
    assert bm.num_free_blocks == 3 and all(bm.ref_count(x) == 1 for x in table), \
        "taking a cached block back takes it out of the free blocks"


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
        "forget them when they are handed out (evict), or sequence 2 reads wrong K/V")


def test_the_shared_prefix_goes_last(impl, parts):
    bm = parts.BlockManager(6, BS, impl.PrefixCache(BS))
    a = tokens(0, 13)  # blocks: 3 full and registered, 1 partial
    computed(bm, 0, a)
    bm.free(0)
    bm.allocate(1, 16, tokens(500, 16))  # 4 of the 6 free blocks, for other tokens
    bm.free(1)
    bm.allocate(2, 13, a)
    assert bm.num_cached_tokens(2) == 8, (
        f"{bm.num_cached_tokens(2)} tokens found, 8 expected: free a sequence's blocks last "
        "block first, and hand out the least recently freed first, so that the tail of a "
        "prompt is reused before its start, which more requests share")


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
        "3; the scheduler sets num_computed_tokens to the block manager's num_cached_tokens")
