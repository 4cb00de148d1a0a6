"""Paged KV memory: a pool of fixed-size blocks and a block table per sequence.

The KV cache is cut into physical blocks of block_size token slots. A sequence sees a list of
logical blocks (its first block_size tokens, the next block_size, ...); its block table maps
each logical block to whichever physical block happened to be free. Nothing needs to be
contiguous, so nothing is reserved ahead of need: a sequence takes a new block only when its
last one is full, and wastes at most block_size - 1 slots (in its last block).

Blocks carry reference counts so sequences can share them: ``fork`` gives a child the parent's
blocks (counts up); before a sequence writes into a block someone else also holds, it gets a
private copy (copy-on-write). When the GPU pool runs out, a sequence's blocks can be swapped out
to a CPU pool and back.

A sliding-window model (every layer attends to the last W tokens only, as Mistral's) does not
need a block once every position in it lies before the window of the next token to compute:
``remove_skipped_blocks`` gives such blocks back while the sequence runs, and the block table
keeps the *null block* in their place (vLLM's ``null_block``), so that entry i still stands for
positions [i * block_size, (i + 1) * block_size). The null block is never handed out and never
written; its K/V rows stay zero, and attention's window mask discards what a kernel reads there.
A sequence then holds at most ceil(W / block_size) + 1 blocks while it decodes, however long.

The manager only does the bookkeeping; it moves no data. Where data must move it returns the
block pairs ("copy block 7 to block 12", "swap GPU block 3 to CPU block 0") for the cache
storage to carry out. Names follow vLLM's BlockSpaceManager.

Which vLLM this follows: the block pool, reference counts, block tables and the prefix cache's
chained block hashes with lazy LRU eviction are V1's KVCacheManager ideas (V1's hash also
chains parent and tokens); swapping to a CPU pool, copy-on-write of a shared last block and
block-level sharing between beams are V0's BlockSpaceManager (V1 dropped swapping and beam
search from the engine core, and preempts by recompute only).

The slot of a token is block_table[position // block_size] * block_size + position % block_size:
its row in the flat pool of slots.
"""

from collections import OrderedDict
from dataclasses import dataclass, field

from .prefix_cache import PrefixCache, block_key


# --8<-- [start:pool]
class BlockPool:
    """Physical blocks of one device: a free list and a reference count per block."""

    def __init__(self, num_blocks: int, device: str, null_block: bool = False):
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks  # blocks it hands out (the null block is not one)
        self.device = device
        # The placeholder of a block given back early (sliding window): the id past the
        # others, never in the free list, never shared or released.
        self.null_block: int | None = num_blocks if null_block else None
        self.ref_counts = [0] * num_blocks
        # Free blocks, oldest first (at the start lowest ids first: block tables read
        # easily). An OrderedDict is a doubly linked list with an index, like vLLM's
        # free block queue: taking out the oldest block, or a given one (a prefix-cache
        # hit), costs O(1).
        self.free_list: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_list)

    def allocate(self) -> int:
        if not self.free_list:
            raise RuntimeError(f"no free {self.device} block: check can_allocate / "
                               "can_append first")
        block, _ = self.free_list.popitem(last=False)  # the oldest free block
        self.ref_counts[block] = 1
        return block

    def take(self, block: int) -> None:
        """Allocate this free block (a prefix-cache hit on a block no one holds any
        more)."""
        del self.free_list[block]
        self.ref_counts[block] = 1
    # --8<-- [end:pool]

    # --8<-- [start:ref_counts]
    def share(self, block: int) -> None:
        assert block != self.null_block, "the null block is never shared"
        assert self.ref_counts[block] > 0, (
            f"sharing {self.device} block {block}, which is free")
        self.ref_counts[block] += 1

    def release(self, block: int) -> None:
        assert block != self.null_block, "the null block is never released"
        assert self.ref_counts[block] > 0, f"{self.device} block {block} freed twice"
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_list[block] = None  # the newest free block
    # --8<-- [end:ref_counts]


@dataclass
class BlockTable:
    """One sequence's logical -> physical mapping and how many token slots it fills."""

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0  # slots in use; the last block holds num_tokens - (len - 1) * block_size
    device: str = "gpu"  # "gpu" while runnable, "cpu" while swapped out
    keys: list[str] = field(default_factory=list)  # prefix-cache keys of its leading full blocks
    num_cached_tokens: int = 0  # tokens whose K/V came from the prefix cache at allocation
    # Leading entries given back (out of a sliding window): placeholders, the null block's id
    # on the device; they move, are shared and are freed with nothing.
    num_skipped_blocks: int = 0

    @property
    def held(self) -> list[int]:
        """The blocks the sequence really holds (not the placeholders)."""
        return self.blocks[self.num_skipped_blocks:]


# --8<-- [start:manager]
class BlockSpaceManager:
    """Allocates, shares, copies on write and swaps the blocks of sequences, by sequence id."""

    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int = 0,
                 enable_prefix_caching: bool = False, sliding_window: int | None = None,
                 pools_of: "BlockSpaceManager | None" = None, group: int = 0,
                 null_block: bool = False):
        """sliding_window: every layer reads only the last W tokens, so blocks wholly before
        the window go back to the pool (``remove_skipped_blocks``); None: full attention,
        every block is held until the sequence ends.

        A model with several KV cache groups (``kv_cache_spec.py``) has one manager per group,
        each with its own block tables, over one pool: pools_of is the first group's manager,
        whose block pools and prefix cache this one shares (num_gpu_blocks, num_cpu_blocks
        and enable_prefix_caching are then its). group is this group's index: it keeps its
        prefix-cache keys apart from the other groups' (the same tokens are other K/V).
        null_block: give the pool its null block even if this group does not slide (a later
        group does)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(
                sliding_window, int) or sliding_window < 1):
            raise ValueError(f"sliding_window must be None or an integer >= 1, got "
                             f"{sliding_window!r}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.tables: dict[int, BlockTable] = {}
        # the first block's parent in the chain of keys: None, or this group's own root
        self.key_root = f"kv cache group {group}" if group else None
        if pools_of is not None:
            self.gpu, self.cpu, self.prefix_cache = (pools_of.gpu, pools_of.cpu,
                                                     pools_of.prefix_cache)
            if sliding_window is not None and self.gpu.null_block is None:
                raise ValueError("a sliding-window group needs a pool with the null block: "
                                 "build the first group's manager with null_block=True")
            return
        self.gpu = BlockPool(num_gpu_blocks, "gpu",
                             null_block=null_block or sliding_window is not None)
        self.cpu = BlockPool(num_cpu_blocks, "cpu")
        self.prefix_cache = PrefixCache(block_size) if enable_prefix_caching else None

    def _new_block(self, pool: BlockPool) -> int:
        block = pool.allocate()
        if self.prefix_cache is not None and pool is self.gpu:
            self.prefix_cache.evict(block)  # lazy eviction: its old content is overwritten now
        return block

    # --8<-- [start:blocks_needed]
    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)  # ceil
    # --8<-- [end:blocks_needed]

    # -- admission ------------------------------------------------------------------------
    def num_new_blocks(self, num_tokens: int, token_ids: list[int] | None = None) -> int:
        """Free blocks an allocation takes: cached blocks another sequence holds cost none."""
        needed = self.blocks_needed(num_tokens)
        if self.prefix_cache is None or not token_ids:
            return needed
        reused = self.prefix_cache.lookup(token_ids, self.key_root)
        skip = self.num_skipped_blocks_at(len(reused) * self.block_size)
        # skipped hits cost nothing (the null block stands in); held hits are shared
        return needed - skip - sum(1 for _, block in reused[skip:]
                                   if self.gpu.ref_counts[block] > 0)

    def can_allocate(self, num_tokens: int, token_ids: list[int] | None = None) -> bool:
        return self.num_new_blocks(num_tokens, token_ids) <= self.gpu.num_free

    # --8<-- [start:allocate]
    def allocate(self, seq_id: int, num_tokens: int,
                 token_ids: list[int] | None = None) -> list[int]:
        """Blocks for a new sequence's first num_tokens (its prompt); returns its block
        table.

        With prefix caching and token_ids given, the longest cached chain of full blocks
        is reused (shared, counts up) and table.num_cached_tokens says how many tokens it
        covers.
        """
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} already has blocks; free it first")
        # --8<-- [start:never_fits]
        needed = self.blocks_needed(num_tokens)
        if needed > self.gpu.num_blocks:
            raise ValueError(f"{num_tokens} tokens need {needed} blocks of "
                             f"{self.block_size}, more than the whole pool of "
                             f"{self.gpu.num_blocks}")
        # --8<-- [end:never_fits]
        if self.num_new_blocks(num_tokens, token_ids) > self.gpu.num_free:
            raise RuntimeError(f"{needed} blocks needed, {self.gpu.num_free} free: "
                               "check can_allocate first")
        reused = []
        if self.prefix_cache and token_ids:
            reused = self.prefix_cache.lookup(token_ids, self.key_root)
        # A sliding window computes from the first uncached token on: the hits wholly before
        # its window are never read, so the null block stands in for them (nothing taken).
        skip = self.num_skipped_blocks_at(len(reused) * self.block_size)
        blocks = [self.gpu.null_block] * skip
        for _, block in reused[skip:]:
            if self.gpu.ref_counts[block] == 0:  # freed but still cached: take it back
                self.gpu.take(block)
            else:  # in use by another sequence right now: share it
                self.gpu.share(block)
            blocks.append(block)
        blocks += [self._new_block(self.gpu) for _ in range(needed - len(reused))]
        table = BlockTable(blocks, num_tokens, keys=[key for key, _ in reused],
                           num_cached_tokens=len(reused) * self.block_size,
                           num_skipped_blocks=skip)
        if reused and self.key_root is None:  # every group hits the same tokens: count once
            self.prefix_cache.record_hit(len(reused))
        self.tables[seq_id] = table
        return table.blocks
    # --8<-- [end:allocate]

    # --8<-- [start:mark_computed]
    def mark_computed(self, seq_id: int, token_ids: list[int], num_computed: int) -> None:
        """The K/V of the sequence's first num_computed tokens are in its blocks: give every
        newly completed full block its key, so later requests can find it."""
        if self.prefix_cache is None:
            return
        table = self._table(seq_id, device="gpu")
        bs = self.block_size
        for i in range(len(table.keys), num_computed // bs):
            parent = table.keys[-1] if table.keys else self.key_root
            table.keys.append(block_key(parent, token_ids[i * bs: (i + 1) * bs]))
            if i >= table.num_skipped_blocks:  # a placeholder holds nothing to find
                self.prefix_cache.register(table.keys[-1], table.blocks[i])
    # --8<-- [end:mark_computed]
# --8<-- [end:manager]

    # -- sliding window: give back what the window left behind --------------------------------
    # --8<-- [start:remove_skipped_blocks]
    def num_skipped_blocks_at(self, num_computed_tokens: int) -> int:
        """Leading blocks no token still to compute reads, once num_computed_tokens are
        computed: the next token, at position c = num_computed_tokens, reads keys at positions
        > c - W, so a block is skipped when all of its positions are <= c - W."""
        if self.sliding_window is None:
            return 0
        num_skipped_tokens = max(0, num_computed_tokens - self.sliding_window + 1)
        return num_skipped_tokens // self.block_size  # whole blocks only

    def remove_skipped_blocks(self, seq_id: int, num_computed_tokens: int) -> int:
        """Give back the blocks that fell wholly out of the sliding window (vLLM's
        ``remove_skipped_blocks``); the null block takes their place in the block table.
        Returns how many were given back. A swapped-out sequence computes nothing: it keeps
        what it has until it is back."""
        table = self._lookup(seq_id)
        if self.sliding_window is None or table.device != "gpu":
            return 0
        skip = min(self.num_skipped_blocks_at(num_computed_tokens), len(table.blocks))
        freed = 0
        for i in range(table.num_skipped_blocks, skip):
            # Shared (a fork, a prefix hit) means one reference less; a prefix-cached block
            # keeps its key while free, so a later prompt can still find it (lazy eviction).
            self.gpu.release(table.blocks[i])
            table.blocks[i] = self.gpu.null_block
            freed += 1
        table.num_skipped_blocks = max(table.num_skipped_blocks, skip)
        return freed
    # --8<-- [end:remove_skipped_blocks]

    # -- decode: one more slot ---------------------------------------------------------------
    # --8<-- [start:last_block_has_room]
    def _last_block_has_room(self, table: BlockTable) -> bool:
        return table.num_tokens < len(table.blocks) * self.block_size
    # --8<-- [end:last_block_has_room]

    def num_blocks_to_append(self, seq_ids: list[int], device: str = "gpu",
                             num_slots: int | list[int] = 1) -> int:
        """Free blocks the sequences' next num_slots tokens (each, or one count per sequence)
        take together (a group appends together): fresh blocks past the last one's room; a
        copy where the last block is shared and has room — except for the last of these
        sharers to write, when nobody else holds the block (by then it owns it alone). device
        "cpu": what the swapped-out sequences would take once back in the GPU pool."""
        pool = self.gpu if device == "gpu" else self.cpu
        counts = [num_slots] * len(seq_ids) if isinstance(num_slots, int) else num_slots
        needed = 0
        sharers: dict[int, int] = {}
        for seq_id, count in zip(seq_ids, counts, strict=True):
            if count <= 0:
                continue  # it holds its slots already
            table = self._table(seq_id, device)
            room = len(table.blocks) * self.block_size - table.num_tokens
            needed += self.blocks_needed(max(count - room, 0))  # past the last block
            if room > 0 and pool.ref_counts[table.blocks[-1]] > 1:
                sharers[table.blocks[-1]] = sharers.get(table.blocks[-1], 0) + 1
        for block, count in sharers.items():
            outside = pool.ref_counts[block] > count
            needed += count if outside else count - 1
        return needed

    def can_append(self, seq_id: int, num_slots: int = 1) -> bool:
        """Can the sequence get slots for num_slots more tokens (new blocks, a private copy)?"""
        return self.num_blocks_to_append([seq_id], num_slots=num_slots) <= self.gpu.num_free

    # --8<-- [start:append_slot]
    def append_slots(self, seq_id: int, num_slots: int = 1) -> tuple[int, int] | None:
        """Reserve the slots of the sequence's next num_slots tokens.

        Returns the copy (src_block, dst_block) when the last block was shared and the
        first new token writes into it (copy-on-write: the copy is made before the write),
        else None. Fresh blocks follow wherever the last block fills.
        """
        table = self._table(seq_id, device="gpu")
        copy = None
        if (num_slots > 0 and self._last_block_has_room(table)
                and self.gpu.ref_counts[table.blocks[-1]] > 1):
            shared = table.blocks[-1]  # others still read it: write into a private copy
            table.blocks[-1] = self._new_block(self.gpu)
            self.gpu.release(shared)
            copy = (shared, table.blocks[-1])
        table.num_tokens += num_slots
        while len(table.blocks) * self.block_size < table.num_tokens:
            table.blocks.append(self._new_block(self.gpu))  # last block full: a fresh one
        return copy
    # --8<-- [end:append_slot]

    def append_slot(self, seq_id: int) -> tuple[int, tuple[int, int] | None]:
        """One more token's slot: (its slot, the copy-on-write pair or None)."""
        copy = self.append_slots(seq_id, 1)
        return self.slot(seq_id, self._lookup(seq_id).num_tokens - 1), copy

    def copy_on_write(self, seq_id: int, position: int) -> list[tuple[int, int]]:
        """Private copies of the shared blocks the sequence writes from `position` on: the
        slots it holds past its computed tokens (proposals booked in an earlier step, then
        forked) are written again, so another holder must keep the old contents. Returns the
        (src, dst) pairs to copy before the write."""
        table = self._table(seq_id, device="gpu")
        copies = []
        for i in range(position // self.block_size, len(table.blocks)):
            shared = table.blocks[i]
            if self.gpu.ref_counts[shared] > 1:
                table.blocks[i] = self._new_block(self.gpu)
                self.gpu.release(shared)
                copies.append((shared, table.blocks[i]))
        return copies

    def num_shared_blocks(self, seq_id: int, position: int) -> int:
        """Copies copy_on_write(seq_id, position) would make, where the sequence holds slots
        past `position` (booked, then forked). Writing from the end of what it holds, the
        only block concerned is the last, whose copy num_blocks_to_append counts."""
        table = self._table(seq_id, device="gpu")
        if position >= table.num_tokens:
            return 0
        return sum(1 for block in table.blocks[position // self.block_size:]
                   if self.gpu.ref_counts[block] > 1)

    # --8<-- [start:truncate]
    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Keep only the slots of the sequence's first num_tokens tokens: the slots booked for
        tokens that were then rejected (speculative decoding) go back. Blocks past the last
        kept token return to the pool. A block the prefix cache knows is never cut: its key
        covers computed tokens only, which are never rejected."""
        table = self._table(seq_id, device="gpu")
        least = max(len(table.keys), table.num_skipped_blocks) * self.block_size
        if not least <= num_tokens <= table.num_tokens:
            raise ValueError(f"sequence {seq_id} can keep between {least} (its prefix-cached "
                             f"blocks, and those its window gave back) and {table.num_tokens} "
                             f"(its slots) tokens, not {num_tokens}")
        keep = self.blocks_needed(num_tokens)
        for block in reversed(table.blocks[keep:]):
            self.gpu.release(block)
        del table.blocks[keep:]
        table.num_tokens = num_tokens
    # --8<-- [end:truncate]

    # --8<-- [start:slot]
    def slot(self, seq_id: int, position: int) -> int:
        """Row of the flat slot pool holding this token's K/V (in the pool the sequence
        is in)."""
        table = self._lookup(seq_id)
        self._check_in_window(seq_id, table, position)
        return table.blocks[position // self.block_size] * self.block_size + (
            position % self.block_size)

    def _check_in_window(self, seq_id: int, table: BlockTable, position: int) -> None:
        """The null block is never written: a position whose block was given back has no
        slot."""
        if position // self.block_size < table.num_skipped_blocks:
            first = table.num_skipped_blocks * self.block_size
            raise ValueError(f"position {position} of sequence {seq_id} fell out of its "
                             f"sliding window of {self.sliding_window}: its block was "
                             f"given back (positions below {first} have no slot)")

    def slot_mapping(self, seq_id: int, positions) -> list[int]:
        return [self.slot(seq_id, p) for p in positions]
    # --8<-- [end:slot]

    # -- sharing ----------------------------------------------------------------------------
    # --8<-- [start:fork]
    def fork(self, parent_id: int, child_id: int) -> None:
        """The child starts as the parent: same blocks, counts up, nothing copied."""
        parent = self._table(parent_id, device="gpu")
        if child_id in self.tables:
            raise ValueError(f"sequence {child_id} already has blocks")
        for block in parent.held:  # the placeholders are nobody's
            self.gpu.share(block)
        self.tables[child_id] = BlockTable(list(parent.blocks), parent.num_tokens,
                                           keys=list(parent.keys),
                                           num_skipped_blocks=parent.num_skipped_blocks)
    # --8<-- [end:fork]

    # -- release ----------------------------------------------------------------------------
    # --8<-- [start:free]
    def free(self, seq_id: int) -> None:
        table = self._lookup(seq_id)
        del self.tables[seq_id]
        pool = self.gpu if table.device == "gpu" else self.cpu
        for block in reversed(table.held):  # deepest first: with prefix caching, the shared
            pool.release(block)  # start of a prompt outlives the tails (evicted first)
    # --8<-- [end:free]

    # -- swapping ---------------------------------------------------------------------------
    # A sequence group (a request's samples or beams) is swapped as a unit, so pass all its
    # sequence ids: a block they share moves once and stays shared on the other side.
    def can_swap_out(self, seq_ids: int | list[int]) -> bool:
        return len(self.group_blocks(seq_ids, "gpu")) <= self.cpu.num_free

    def swap_out(self, seq_ids: int | list[int]) -> list[tuple[int, int]]:
        """Move the sequences' blocks to the CPU pool; returns (gpu_block, cpu_block) pairs."""
        return self._move(seq_ids, self.gpu, self.cpu)

    def can_swap_in(self, seq_ids: int | list[int]) -> bool:
        ids = [seq_ids] if isinstance(seq_ids, int) else list(seq_ids)
        # plus one spare block per sequence for the token each appends next
        return len(self.group_blocks(ids, "cpu")) + len(ids) <= self.gpu.num_free

    def swap_in(self, seq_ids: int | list[int]) -> list[tuple[int, int]]:
        """Bring swapped-out sequences back; returns (cpu_block, gpu_block) pairs."""
        return self._move(seq_ids, self.cpu, self.gpu)

    def group_blocks(self, seq_ids: int | list[int], device: str) -> list[int]:
        """The distinct blocks the sequences hold on the device (a shared block once)."""
        ids = [seq_ids] if isinstance(seq_ids, int) else list(seq_ids)
        return list(dict.fromkeys(b for i in ids for b in self._table(i, device).held))

    # --8<-- [start:move]
    def _move(self, seq_ids: int | list[int], src: BlockPool,
              dst: BlockPool) -> list[tuple[int, int]]:
        ids = [seq_ids] if isinstance(seq_ids, int) else list(seq_ids)
        unique = self.group_blocks(ids, src.device)
        if len(unique) > dst.num_free:
            raise ValueError(f"moving sequences {ids} to the {dst.device} needs {len(unique)} "
                             f"blocks, {dst.num_free} are free; nothing was moved")
        moved = {block: self._new_block(dst) for block in unique}  # one reference each
        seen = set()
        for seq_id in ids:
            table = self.tables[seq_id]
            for block in table.held:  # the placeholders stay placeholders: nothing to move
                if moved[block] in seen:
                    dst.share(moved[block])  # a further reference from within the group
                seen.add(moved[block])
                src.release(block)  # a block shared outside the group stays for the others
            skip = table.num_skipped_blocks
            table.blocks = table.blocks[:skip] + [moved[b] for b in table.held]
            table.device = dst.device
        return list(moved.items())
    # --8<-- [end:move]

    # -- inspection -------------------------------------------------------------------------
    def _lookup(self, seq_id: int) -> BlockTable:
        table = self.tables.get(seq_id)
        if table is None:
            raise ValueError(f"sequence {seq_id} holds no blocks (never allocated, or freed)")
        return table

    def _table(self, seq_id: int, device: str) -> BlockTable:
        table = self._lookup(seq_id)
        if table.device != device:
            raise ValueError(f"sequence {seq_id} is on the {table.device}, not the {device}")
        return table

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._lookup(seq_id).blocks)

    def block_ids(self, seq_id: int) -> list[int]:
        """The sequence's blocks, not copied (the step's inputs read them every step): do not
        modify."""
        return self._lookup(seq_id).blocks

    def num_tokens(self, seq_id: int) -> int:
        return self._lookup(seq_id).num_tokens

    def num_skipped_blocks(self, seq_id: int) -> int:
        """Leading entries of the sequence's block table that are placeholders (the null
        block): blocks its sliding window gave back."""
        return self._lookup(seq_id).num_skipped_blocks

    def num_held_blocks(self, seq_id: int) -> int:
        """Blocks the sequence holds, placeholders not counted."""
        return len(self._lookup(seq_id).held)

    def num_cached_tokens(self, seq_id: int) -> int:
        """Leading tokens whose K/V the prefix cache supplied when the sequence was allocated."""
        return self._lookup(seq_id).num_cached_tokens

    def holds(self, seq_id: int) -> bool:
        return seq_id in self.tables

    @property
    def num_seqs(self) -> int:
        """Sequences holding blocks now (in either pool)."""
        return len(self.tables)

    @property
    def num_free_gpu_blocks(self) -> int:
        return self.gpu.num_free

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.cpu.num_free
