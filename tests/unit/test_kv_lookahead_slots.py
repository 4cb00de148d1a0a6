"""Slots booked for tokens that may be rejected (speculative decoding's memory), under random
sequences of admissions, forks, steps with lookahead, rejections and frees (hypothesis).

Each step books slots for the token a sequence computes and for k proposed tokens
(``allocate_slots(seq, 1, k)``), writes every one of them into a shadow of the pool, accepts
some of the proposals and gives the rest back (``truncate_slots``). The invariants: a sequence
reads back exactly the tokens it kept; no block leaks once every sequence is freed; and a later
prompt never finds, in the prefix cache, a block holding a rejected token.
"""

from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedllm.reference.kv import (
    CacheEngine,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    PagedKVCacheManager,
)

BLOCK_SIZE, NUM_BLOCKS = 4, 24
REJECTED = -1  # what a rejected proposal's slot holds in the shadow


@dataclass(eq=False)
class Seq:
    seq_id: int
    token_ids: list[int]
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass(eq=False)
class Group:
    seqs: list[Seq]
    reads_prefix_cache: bool = True

    def unfinished_seqs(self) -> list[Seq]:
        return self.seqs


class LookaheadMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.kv = PagedKVCacheManager(BLOCK_SIZE, NUM_BLOCKS, enable_prefix_caching=True)
        self.shadow: dict[int, int] = {}  # slot -> the token whose K/V it holds
        self.live: list[Seq] = []
        self.holds_extra: set[int] = set()  # sequences holding slots past their computed ones
        self.next_id = 0

    def _new_seq(self, tokens: list[int]) -> Seq:
        self.next_id += 1
        return Seq(self.next_id, list(tokens))

    def _write(self, seq: Seq, start: int, values: list[int]) -> None:
        for slot, value in zip(self.kv.slot_mapping(seq, start, start + len(values)), values,
                               strict=True):
            self.shadow[slot] = value

    @rule(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=14))
    def admit(self, prompt):
        seq = self._new_seq(prompt)
        group = Group([seq])
        if not self.kv.can_admit(group):
            return
        (blocks,) = self.kv.admit(group)
        cached = blocks.num_cached_tokens
        # a prefix-cache hit must hold exactly this prompt's tokens (never a rejected one)
        read = [self.shadow.get(s) for s in self.kv.slot_mapping(seq, 0, cached)]
        assert read == prompt[:cached], f"a cached block holds {read}, not {prompt[:cached]}"
        # the prefill computes the rest of the prompt and samples a first token
        self._write(seq, cached, prompt[cached:])
        seq.num_computed_tokens = len(prompt)
        self.kv.mark_computed(seq)
        seq.token_ids.append(0)
        self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), lookahead=st.integers(0, 5))
    def step_with_proposals(self, data, lookahead):
        seq = data.draw(st.sampled_from(self.live))
        group = Group([seq])
        if not self.kv.can_allocate_slots(group, 1, lookahead):
            return
        for src, dst in self.kv.allocate_slots(seq, 1, lookahead):
            # copy-on-write: the storage copies the block before the write
            for offset in range(BLOCK_SIZE):
                if src * BLOCK_SIZE + offset in self.shadow:
                    self.shadow[dst * BLOCK_SIZE + offset] = self.shadow[
                        src * BLOCK_SIZE + offset]
        start = seq.num_computed_tokens
        proposals = data.draw(st.lists(st.integers(0, 3), min_size=lookahead,
                                       max_size=lookahead))
        # the forward writes the newest token's K/V and every proposal's
        self._write(seq, start, [seq.token_ids[start]] + proposals)
        accepted = data.draw(st.integers(0, lookahead))
        bonus = data.draw(st.integers(0, 3))  # the target's own token after the accepted ones
        seq.token_ids += proposals[:accepted] + [bonus]
        seq.num_computed_tokens = start + 1 + accepted
        for slot in self.kv.slot_mapping(seq, seq.num_computed_tokens,
                                         start + 1 + lookahead):
            self.shadow[slot] = REJECTED  # what the rejected proposals left in the pool
        self.kv.mark_computed(seq)  # before the rejected slots go: it must skip them itself
        if data.draw(st.booleans()):
            # forked while it still holds the rejected proposals' slots: the child keeps
            # them (given back or written again in its own later steps), so a later write of
            # either must copy the shared blocks first
            child = self._new_seq(seq.token_ids)
            child.num_computed_tokens = seq.num_computed_tokens
            self.kv.fork(seq, child)
            self.live.append(child)
            self.holds_extra.add(child.seq_id)
        self.kv.truncate_slots(seq, seq.num_computed_tokens)
        self.holds_extra.discard(seq.seq_id)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.live))
        child = self._new_seq(parent.token_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        self.kv.fork(parent, child)
        self.live.append(child)
        if parent.seq_id in self.holds_extra:
            self.holds_extra.add(child.seq_id)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.live.remove(seq)
        self.kv.free_seq(seq)

    @invariant()
    def every_sequence_reads_what_it_kept(self):
        for seq in self.live:
            n = seq.num_computed_tokens
            if seq.seq_id not in self.holds_extra:
                assert len(self.kv.block_table(seq)) == -(-n // BLOCK_SIZE), "slots kept"
            read = [self.shadow.get(s) for s in self.kv.slot_mapping(seq, 0, n)]
            assert read == seq.token_ids[:n]

    def teardown(self):
        for seq in self.live:
            self.kv.free_seq(seq)
        assert self.kv.num_free_blocks == NUM_BLOCKS and self.kv.num_seqs == 0


LookaheadMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                              deadline=None)
TestLookaheadSlots = LookaheadMachine.TestCase


def test_truncate_refuses_to_cut_into_prefix_cached_tokens():
    kv = PagedKVCacheManager(BLOCK_SIZE, NUM_BLOCKS, enable_prefix_caching=True)
    seq = Seq(1, list(range(9)))
    kv.admit(Group([seq]))
    seq.num_computed_tokens = 8
    kv.mark_computed(seq)  # two full blocks are in the prefix cache
    with pytest.raises(ValueError, match="between 8"):
        kv.truncate_slots(seq, 5)
    kv.truncate_slots(seq, 8)
    assert len(kv.get_block_ids(seq)[0]) == 2


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "int4"])
def test_a_specs_bytes_are_the_pools_bytes(kv_cache_dtype):
    """The planner's bytes (the spec's page size) are what the runner allocates."""
    spec = FullAttentionSpec(BLOCK_SIZE, num_kv_heads=2, head_size=16, dtype=__import__(
        "torch").bfloat16, kv_cache_dtype=kv_cache_dtype)
    config = KVCacheConfig(NUM_BLOCKS, 0, (KVCacheGroupSpec(tuple(range(3)), spec),))
    pool = CacheEngine.from_kv_cache_config(config, "cpu")
    assert pool.nbytes() == config.bytes_per_block * NUM_BLOCKS == 3 * spec.page_size_bytes \
        * NUM_BLOCKS


def test_a_fork_holding_booked_slots_copies_before_either_writes_again():
    """Forked after booking proposals' slots (before the step gave them back), parent and
    child share blocks they will both write from their computed position on: the first of
    them to write again gets private copies of every such block, the second owns the rest."""
    kv = PagedKVCacheManager(BLOCK_SIZE, NUM_BLOCKS)
    parent = Seq(1, list(range(7)))
    kv.admit(Group([parent]))
    parent.num_computed_tokens = 6  # its 7th token is computed next, with 3 proposals
    assert kv.allocate_slots(parent, 1, 3) == []
    assert kv.get_block_ids(parent) == ([0, 1, 2],)  # positions 6..9
    child = Seq(2, list(parent.token_ids), num_computed_tokens=6)
    kv.fork(parent, child)
    copies = kv.allocate_slots(child, 1, 3)  # writes positions 6..9 again: blocks 1 and 2
    assert [src for src, _ in copies] == [1, 2]
    assert kv.allocate_slots(parent, 1, 3) == []  # the blocks are the parent's alone now
    assert not set(kv.get_block_ids(parent)[0][1:]) & set(kv.get_block_ids(child)[0][1:])
