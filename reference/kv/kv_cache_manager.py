"""The engine's KV bookkeeping: which slots each sequence owns, in either layout. No tensors.

Two layouts behind the same verbs, so one scheduler drives either:

- ``PagedKVCacheManager``: a BlockSpaceManager over a block pool (and a CPU pool to swap to). A
  sequence takes blocks for its current tokens and one more whenever its last block fills. For
  a sliding-window model (its KV cache group's spec is a ``SlidingWindowSpec``), the blocks that
  fall wholly out of the window go back as the sequence computes (after every step's tokens,
  and before it books more: ``remove_skipped_blocks``), so that while it decodes it holds at
  most ceil(W / block_size) + 1 blocks.
- ``ContiguousKVCacheManager``: a ContiguousAllocator over one linear space. A sequence
  reserves, at admission, a slab for everything it may ever hold (policy max / pow2 / oracle);
  it never needs more, so it never waits for memory once running, but pays up front.

Verbs: can_admit / admit (a waiting group's tokens), can_allocate_slots / allocate_slots (slots
for the tokens each running sequence computes next, and for lookahead tokens that may yet be
rejected), truncate_slots (give the rejected ones back), free, fork, swap_out / swap_in (paged
only), and for the step's inputs block_table / slot_mapping; get_block_ids, a copy, for anyone
else. Where data must move, a verb returns block pairs and
the scheduler passes them on in its output; the cache engine (``cache_engine.py``) moves them.

A group is anything with ``seqs``, ``unfinished_seqs()``, ``sampling_params.max_tokens`` and
``reads_prefix_cache`` (False: admission looks nothing up in the prefix cache for it); a
sequence anything with ``seq_id``, ``token_ids``, ``output_token_ids`` and a length (the
engine's SequenceGroup and Sequence): this package never imports the engine.
"""

from dataclasses import dataclass

from .block_manager import BlockSpaceManager
from .contiguous_allocator import ContiguousAllocator
from .kv_cache_spec import KVCacheGroupSpec, SlidingWindowSpec


@dataclass
class KVCacheBlocks:
    """What admitting a sequence gave it (vLLM's KVCacheBlocks): its blocks, and how many of
    its leading tokens they already hold (prefix-cache hits, which need no prefill)."""

    block_ids: list[int]
    num_cached_tokens: int = 0


def _books_per_chunk(m: BlockSpaceManager) -> bool:
    """A windowed group books a prompt chunk by chunk (``PagedKVCacheManager.books_per_chunk``)."""
    return m.sliding_window is not None


def _lookup_ids(group, seq) -> list[int] | None:
    """The tokens to look up in the prefix cache at admission: none (no lookup) for a group
    that must compute every prompt position (it wants its prompt logprobs)."""
    return seq.token_ids if group.reads_prefix_cache else None


WATERMARK = 0.01  # admission leaves 1 % of the blocks free, as vLLM does, so that a request just
# admitted is not preempted at its first decode step


class PagedKVCacheManager:
    layout = "paged"

    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int = 0,
                 enable_prefix_caching: bool = False,
                 kv_cache_groups: tuple[KVCacheGroupSpec, ...] = ()):
        """kv_cache_groups: what the layers cache (the runner's ``get_kv_cache_spec``); none
        given: full attention. Several groups (a model mixing windowed and full layers): one
        BlockSpaceManager per group, each with its own block tables, over one shared pool
        (vLLM's hybrid KV cache coordinator); every verb below acts on every group."""
        for group in kv_cache_groups:
            if group.kv_cache_spec.block_size != block_size:
                raise ValueError(f"kv_cache_groups: a spec's block_size "
                                 f"{group.kv_cache_spec.block_size} is not the pool's "
                                 f"{block_size}")
        specs = [g.kv_cache_spec for g in kv_cache_groups] or [None]
        self.kv_cache_spec = specs[0]
        windows = [s.sliding_window if isinstance(s, SlidingWindowSpec) else None
                   for s in specs]
        first = BlockSpaceManager(block_size, num_gpu_blocks, num_cpu_blocks,
                                  enable_prefix_caching, sliding_window=windows[0],
                                  null_block=any(w is not None for w in windows))
        self.managers = [first] + [
            BlockSpaceManager(block_size, num_gpu_blocks, sliding_window=w, pools_of=first,
                              group=g) for g, w in enumerate(windows[1:], start=1)]
        self.manager = first  # the pools, reference counts and prefix cache are its
        self.block_size = block_size
        self.watermark_blocks = int(WATERMARK * num_gpu_blocks)
        self.num_cow_copies = 0

    @property
    def num_kv_cache_groups(self) -> int:
        """Block tables per sequence: one per group of layers."""
        return len(self.managers)

    @property
    def num_total_blocks(self) -> int:
        return self.manager.gpu.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.manager.num_free_gpu_blocks

    @property
    def num_swapped_blocks(self) -> int:
        """CPU blocks holding swapped-out K/V now."""
        return self.manager.cpu.num_blocks - self.manager.num_free_cpu_blocks

    @property
    def null_block(self) -> int | None:
        """The placeholder id in a block table where the window gave a block back (None: this
        pool's sequences hold every block to the end)."""
        return self.manager.gpu.null_block

    def num_held_blocks(self, seq) -> int:
        """Blocks the sequence holds now in every group, placeholders not counted (0: it
        holds none)."""
        if not self.manager.holds(seq.seq_id):
            return 0
        return sum(m.num_held_blocks(seq.seq_id) for m in self.managers)

    @property
    def prefix_cache(self):
        return self.manager.prefix_cache

    @property
    def books_per_chunk(self) -> bool:
        """Does some group book a prompt chunk by chunk, as it is computed (vLLM V1), rather
        than all at admission? A windowed group does: it never holds more than its window and
        a chunk, so a prompt longer than the pool still runs (a Mistral pool; a hybrid
        pool's windowed groups). A group that keeps every token needs the whole prompt's
        blocks by the end of its prefill anyway: it books them at admission, so it never
        waits halfway."""
        return any(_books_per_chunk(m) for m in self.managers)

    def never_fits(self, num_tokens: int, copies: int = 1,
                   chunk_tokens: int | None = None) -> bool:
        """Would `copies` sequences of num_tokens tokens, sharing nothing, overflow the pool?
        chunk_tokens: the most tokens a step computes for one sequence, where prefills are
        chunked (None: a prefill, or a recompute after preemption, computes all its tokens
        in one step). A windowed group that books per chunk needs at most a window and a
        chunk's blocks a sequence: positions c - W + 1 .. c + n - 1 span
        ceil((W - 1 + n) / block) + 1 blocks."""
        def peak(m) -> int:
            if chunk_tokens is None or not _books_per_chunk(m):
                return m.blocks_needed(num_tokens)
            span = m.blocks_needed(m.sliding_window - 1 + chunk_tokens) + 1
            return min(m.blocks_needed(num_tokens), span)
        return copies * sum(peak(m) for m in self.managers) > self.num_total_blocks

    def never_fits_beams(self, prompt_len: int, num_tokens: int, beam_width: int) -> bool:
        """Beams share the prompt's blocks; each may hold its own tokens and one spare block
        (the copy-on-write of a shared last block), in every group."""
        bn = self.manager.blocks_needed
        need = bn(prompt_len) + beam_width * (bn(num_tokens - prompt_len) + 1)
        return need * len(self.managers) > self.num_total_blocks

    def _prefix_hit(self, group, seq) -> tuple[list[int] | None, int]:
        """(the tokens to look up in the prefix cache, how many leading full blocks it holds
        in every group): a hit must hold in all groups (the prefill starts after it in all of
        them), so the ids are cut to the shortest hit."""
        ids, cache = _lookup_ids(group, seq), self.manager.prefix_cache
        if ids is None or cache is None:
            return ids, 0
        hits = min(len(cache.lookup(ids, m.key_root)) for m in self.managers)
        return ids[:hits * self.block_size + 1], hits  # lookup leaves the last id to compute

    def _booked_at_admission(self, m, seq, hits: int, num_new_tokens: int | None) -> int:
        """Tokens whose slots admission books in group m: all of them, or in a group that
        books per chunk the prefix-cache hits (their blocks exist) and, for can_admit, the
        first chunk of num_new_tokens (None: only the hits)."""
        if not _books_per_chunk(m):
            return len(seq)
        return min(len(seq), hits * self.block_size + (num_new_tokens or 0))

    # --8<-- [start:can_admit]
    def can_admit(self, group, num_new_tokens: int | None = None) -> bool:
        """Room for the group's sequences (num_new_tokens: the most its first step computes
        for one, where a group books per chunk)."""
        needed = 0
        for s in group.unfinished_seqs():
            ids, hits = self._prefix_hit(group, s)
            needed += sum(m.num_new_blocks(self._booked_at_admission(m, s, hits,
                                                                     num_new_tokens), ids)
                          for m in self.managers)
        return self.num_free_blocks - needed >= min(self.watermark_blocks,
                                                    self.num_total_blocks - needed)
    # --8<-- [end:can_admit]

    # --8<-- [start:admit]
    def admit(self, group) -> list[KVCacheBlocks]:
        """Blocks for every unfinished sequence's tokens (in a group that books per chunk,
        for its prefix-cache hits only: its prefill books the rest), and how many of its
        leading tokens the prefix cache already holds (they need no prefill). Every group
        takes its hits before any takes a fresh block: a fresh block is the oldest free one,
        which may be another group's cached block, and taking it would lose that hit."""
        admitted = []
        for seq in group.unfinished_seqs():
            ids, hits = self._prefix_hit(group, seq)
            for m in self.managers:  # the hits: shared, or taken back from the free list
                m.allocate(seq.seq_id, hits * self.block_size, ids)
            for m in self.managers:  # then fresh blocks for the rest
                m.append_slots(seq.seq_id, self._booked_at_admission(m, seq, hits, None)
                               - hits * self.block_size)
            cached = {m.num_cached_tokens(seq.seq_id) for m in self.managers}
            assert cached == {hits * self.block_size}, cached
            admitted.append(KVCacheBlocks(self.manager.block_table(seq.seq_id),
                                          hits * self.block_size))
        return admitted
    # --8<-- [end:admit]

    def open_seq(self, seq) -> None:
        """An empty block table in every group for a sequence that books its slots as it
        computes (``allocate_slots``): a draft model's copy of a target sequence."""
        for m in self.managers:
            m.allocate(seq.seq_id, 0)

    # --8<-- [start:mark_computed]
    def mark_computed(self, seq) -> None:
        """The sequence's first seq.num_computed_tokens tokens are computed: their full blocks
        become findable (prefix caching), then the blocks its window left behind go back."""
        for m in self.managers:
            if m.prefix_cache is not None:  # else nothing is looked up later
                m.mark_computed(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
            m.remove_skipped_blocks(seq.seq_id, seq.num_computed_tokens)
    # --8<-- [end:mark_computed]

    @staticmethod
    def _slots_wanted(m, seq, num_new_tokens: int, num_lookahead_tokens: int) -> int:
        """Slots the sequence lacks in group m for its computed tokens, this step's and the
        lookahead (a group that books per chunk may hold fewer than another)."""
        wanted = seq.num_computed_tokens + num_new_tokens + num_lookahead_tokens
        return wanted - m.num_tokens(seq.seq_id)

    def can_allocate_slots(self, group, num_new_tokens: int = 1,
                           num_lookahead_tokens: int = 0, seqs=None) -> bool:
        """Blocks for every sequence of the group's allocate_slots, in every KV cache group:
        fresh blocks past the last one's room; a copy where it is shared — except for the
        last of the group's sharers to write, when nobody outside the group holds the block
        (by then it owns the block alone); and a copy of every shared block a sequence
        writes into again (slots it held past its computed tokens when it was forked:
        counted whole, never short). seqs: these of the group's sequences only (one
        prompt's chunk)."""
        seqs = group.unfinished_seqs() if seqs is None else seqs
        needed = 0
        for m in self.managers:
            wanted = [self._slots_wanted(m, s, num_new_tokens, num_lookahead_tokens)
                      for s in seqs]
            needed += m.num_blocks_to_append([s.seq_id for s in seqs], num_slots=wanted)
            needed += sum(m.num_shared_blocks(s.seq_id, s.num_computed_tokens) for s in seqs)
        return needed <= self.num_free_blocks

    # --8<-- [start:append]
    def allocate_slots(self, seq, num_new_tokens: int = 1,
                       num_lookahead_tokens: int = 0) -> list[tuple[int, int]]:
        """Slots for the num_new_tokens tokens whose K/V this step computes, from
        seq.num_computed_tokens on, and num_lookahead_tokens more after them (tokens proposed
        but not yet accepted: speculative decoding; ``truncate_slots`` gives back the
        rejected ones). Slots the sequence already holds count. Returns the block pairs to
        copy first where a block it writes into is shared (copy-on-write). Blocks out of a
        sliding window go back first (vLLM's order: even if nothing more is booked)."""
        copies = []
        for m in self.managers:
            m.remove_skipped_blocks(seq.seq_id, seq.num_computed_tokens)
            copies += m.copy_on_write(seq.seq_id, seq.num_computed_tokens)
            wanted = self._slots_wanted(m, seq, num_new_tokens, num_lookahead_tokens)
            copy = m.append_slots(seq.seq_id, max(wanted, 0))
            copies += [copy] if copy else []
        self.num_cow_copies += len(copies)
        return copies
    # --8<-- [end:append]

    def truncate_slots(self, seq, num_tokens: int) -> None:
        """Keep the slots of the sequence's first num_tokens tokens, give back the rest (the
        slots of rejected proposals); the block table shrinks with them. A prefix-cached block
        is never given back: it holds accepted, computed tokens only."""
        for m in self.managers:
            m.truncate(seq.seq_id, num_tokens)

    def free(self, group) -> None:
        for seq in group.seqs:
            self.free_seq(seq)

    def free_seq(self, seq) -> None:
        for m in self.managers:
            if m.holds(seq.seq_id):
                m.free(seq.seq_id)

    def fork(self, parent, child) -> None:
        """The child shares every block of the parent (parallel sampling, beam search): nothing
        is copied until one of them writes into a shared block."""
        for m in self.managers:
            m.fork(parent.seq_id, child.seq_id)

    def can_swap_out(self, group) -> bool:
        seq_ids = [s.seq_id for s in group.unfinished_seqs()]
        blocks = sum(len(m.group_blocks(seq_ids, "gpu")) for m in self.managers)
        return blocks <= self.manager.num_free_cpu_blocks

    def swap_out(self, group) -> list[tuple[int, int]]:
        """(gpu block, cpu block) pairs whose data the cache engine must move."""
        seq_ids = [s.seq_id for s in group.unfinished_seqs()]
        return [pair for m in self.managers for pair in m.swap_out(seq_ids)]

    def can_swap_in(self, group) -> bool:
        """Room for the group's blocks and for the token each sequence appends next: exactly
        what it needs, so a group that ran in the pool once always fits an empty pool."""
        seq_ids = [s.seq_id for s in group.unfinished_seqs()]
        blocks = sum(len(m.group_blocks(seq_ids, "cpu")) + m.num_blocks_to_append(seq_ids, "cpu")
                     for m in self.managers)
        return blocks <= self.num_free_blocks

    def swap_in(self, group) -> list[tuple[int, int]]:
        """(cpu block, gpu block) pairs whose data the cache engine must move."""
        seq_ids = [s.seq_id for s in group.unfinished_seqs()]
        return [pair for m in self.managers for pair in m.swap_in(seq_ids)]

    def get_block_ids(self, seq) -> tuple[list[int], ...]:
        """A copy of the sequence's block tables, one list per KV cache group (vLLM's
        ``KVCacheManager.get_block_ids``): for figures, benchmarks and tests, which must never
        hold the live tables."""
        return tuple(list(m.block_ids(seq.seq_id)) if m.holds(seq.seq_id) else []
                     for m in self.managers)

    # -- for the step's inputs ----------------------------------------------------------------
    def block_table(self, seq, kv_cache_group: int = 0) -> list[int]:
        """The sequence's blocks in order in one KV cache group (read-only: the live table,
        not a copy)."""
        return self.managers[kv_cache_group].block_ids(seq.seq_id)

    def slot_mapping(self, seq, start: int, end: int, kv_cache_group: int = 0) -> list[int]:
        """Slots of the sequence's positions [start, end) in one KV cache group: never in the
        null block (a position whose block the window gave back is not written again)."""
        m = self.managers[kv_cache_group]
        blocks, bs = m.block_ids(seq.seq_id), self.block_size
        if start < end and start // bs < m.num_skipped_blocks(seq.seq_id):
            m.slot(seq.seq_id, start)  # raises, naming the position and the window
        return [blocks[p // bs] * bs + p % bs for p in range(start, end)]

    @property
    def num_seqs(self) -> int:
        """Sequences holding KV memory now (a leak check: 0 once every request finished)."""
        return self.manager.num_seqs

    def prefix_cache_stats(self) -> dict:
        cache = self.manager.prefix_cache
        if cache is None:
            return {}
        return {"prefix_cache_hit_blocks": cache.hit_blocks,
                "prefix_cache_hit_tokens": cache.hit_tokens,
                "blocks_cached": len(cache.block_of)}


class ContiguousKVCacheManager:
    """Slabs over a linear space of num_slots token slots. In the step's inputs a slab is a
    block table of one-token blocks: start, start + 1, ... (block_size 1)."""

    layout = "contiguous"
    block_size = 1  # stats and the cache engine count slots as blocks of one
    num_kv_cache_groups = 1  # a slab per sequence, whatever the layers
    books_per_chunk = False  # a slab is reserved whole at admission

    def __init__(self, num_slots: int, policy: str, max_model_len: int):
        self.allocator = ContiguousAllocator(num_slots, policy, max_model_len)
        self.max_model_len = max_model_len
        self.num_swapped_blocks = 0
        self.num_cow_copies = 0  # slabs are never shared

    @property
    def num_total_blocks(self) -> int:
        return self.allocator.total_slots

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.total_slots - sum(s.length for s in self.allocator.slabs)

    def _lengths(self, group, seq) -> tuple[int, int]:
        """(tokens it holds now, tokens it may still add) — the slab must cover both."""
        remaining = group.sampling_params.max_tokens - len(seq.output_token_ids)
        return len(seq), max(1, min(remaining, self.max_model_len - len(seq)))

    def never_fits(self, num_tokens: int, copies: int = 1,
                   chunk_tokens: int | None = None) -> bool:
        return min(num_tokens, self.max_model_len) > self.allocator.total_slots or (
            self.allocator.policy == "max" and self.max_model_len > self.allocator.total_slots)

    def can_admit(self, group, num_new_tokens: int | None = None) -> bool:
        return all(self.allocator.can_allocate(*self._lengths(group, s))
                   for s in group.unfinished_seqs())

    def admit(self, group) -> list[KVCacheBlocks]:
        admitted = []
        for seq in group.unfinished_seqs():  # nothing is ever found cached
            self.allocator.allocate(seq.seq_id, *self._lengths(group, seq))
            admitted.append(KVCacheBlocks(self.block_table(seq)))
        return admitted

    def mark_computed(self, seq) -> None:
        pass  # slabs are never shared, so there is nothing to look up later

    def can_allocate_slots(self, group, num_new_tokens: int = 1,
                           num_lookahead_tokens: int = 0) -> bool:
        """Always: the slab was reserved for every token the request may produce. Booking
        past it is a bug, which allocate_slots raises (never a preemption that cannot help)."""
        return True

    def allocate_slots(self, seq, num_new_tokens: int = 1,
                       num_lookahead_tokens: int = 0) -> list[tuple[int, int]]:
        wanted = seq.num_computed_tokens + num_new_tokens + num_lookahead_tokens
        while self.allocator.num_tokens(seq.seq_id) < wanted:
            self.allocator.append_slot(seq.seq_id)  # raises past the declared length
        return []  # never a copy: nothing is shared

    def truncate_slots(self, seq, num_tokens: int) -> None:
        self.allocator.truncate(seq.seq_id, num_tokens)

    def free(self, group) -> None:
        for seq in group.seqs:
            self.free_seq(seq)

    def free_seq(self, seq) -> None:
        if self.allocator.holds(seq.seq_id):
            self.allocator.free(seq.seq_id)

    def get_block_ids(self, seq) -> tuple[list[int], ...]:
        return (self.block_table(seq) if self.allocator.holds(seq.seq_id) else [],)

    def block_table(self, seq) -> list[int]:
        start, _ = self.allocator.slab(seq.seq_id)
        return list(range(start, start + len(seq)))

    def slot_mapping(self, seq, start: int, end: int) -> list[int]:
        slab_start, _ = self.allocator.slab(seq.seq_id)
        return list(range(slab_start + start, slab_start + end))

    @property
    def num_seqs(self) -> int:
        return len(self.allocator.slabs)

    def prefix_cache_stats(self) -> dict:
        return {}
