"""Solution of milestones 2 and 4: the block manager, with and without a prefix cache."""

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class Table:
    blocks: list[int] = field(default_factory=list)  # logical block i -> physical block
    num_tokens: int = 0  # slots in use
    keys: list[str] = field(default_factory=list)  # prefix-cache keys of its leading blocks
    num_cached_tokens: int = 0  # tokens the prefix cache supplied at allocation


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_cache=None):
        self.num_blocks, self.block_size, self.prefix_cache = num_blocks, block_size, prefix_cache
        self.ref_counts = [0] * num_blocks
        # Free blocks, least recently freed first; an OrderedDict also removes a given block
        # (a prefix-cache hit on a freed block) in O(1).
        self.free_list: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.tables: dict[int, Table] = {}

    # -- the pool -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_list)

    def ref_count(self, block: int) -> int:
        return self.ref_counts[block]

    def _new_block(self) -> int:
        block, _ = self.free_list.popitem(last=False)
        self.ref_counts[block] = 1
        if self.prefix_cache is not None:
            self.prefix_cache.evict(block)  # its old content is about to be overwritten
        return block

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_list[block] = None  # the most recently freed: reused last

    def _table(self, seq_id: int) -> Table:
        if seq_id not in self.tables:
            raise ValueError(f"sequence {seq_id} holds no blocks (never allocated, or freed)")
        return self.tables[seq_id]

    # -- allocation -----------------------------------------------------------------------
    def _blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _hits(self, token_ids) -> list[tuple[str, int]]:
        if self.prefix_cache is None or not token_ids:
            return []
        return self.prefix_cache.lookup(list(token_ids))

    def _num_new_blocks(self, num_tokens: int, token_ids) -> int:
        # A hit on a block someone holds costs no free block; a hit on a freed one does.
        held = sum(1 for _, block in self._hits(token_ids) if self.ref_counts[block] > 0)
        return self._blocks_needed(num_tokens) - held

    def can_allocate(self, num_tokens: int, token_ids=None) -> bool:
        return self._num_new_blocks(num_tokens, token_ids) <= self.num_free_blocks

    def allocate(self, seq_id: int, num_tokens: int, token_ids=None) -> list[int]:
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} already holds blocks; free it first")
        if not self.can_allocate(num_tokens, token_ids):
            raise RuntimeError(f"{self._num_new_blocks(num_tokens, token_ids)} free blocks "
                               f"needed, {self.num_free_blocks} free: check can_allocate first")
        hits = self._hits(token_ids)
        table = Table(num_tokens=num_tokens, keys=[key for key, _ in hits],
                      num_cached_tokens=len(hits) * self.block_size)
        for _, block in hits:
            if self.ref_counts[block] == 0:  # freed but still cached: take it back
                del self.free_list[block]
            self.ref_counts[block] += 1
            table.blocks.append(block)
        table.blocks += [self._new_block() for _ in range(self._blocks_needed(num_tokens)
                                                          - len(hits))]
        self.tables[seq_id] = table
        return list(table.blocks)

    def num_cached_tokens(self, seq_id: int) -> int:
        return self._table(seq_id).num_cached_tokens

    def mark_computed(self, seq_id: int, token_ids, num_computed: int) -> None:
        if self.prefix_cache is None:
            return
        table, bs = self._table(seq_id), self.block_size
        for i in range(len(table.keys), num_computed // bs):  # newly completed full blocks
            parent = table.keys[-1] if table.keys else None
            table.keys.append(self.prefix_cache.key(parent, list(token_ids[i * bs:(i + 1) * bs])))
            self.prefix_cache.register(table.keys[-1], table.blocks[i])

    # -- growth ---------------------------------------------------------------------------
    def _needs_block(self, table: Table) -> bool:
        full = table.num_tokens == len(table.blocks) * self.block_size
        return full or self.ref_counts[table.blocks[-1]] > 1  # full, or shared: copy it

    def can_append(self, seq_id: int) -> bool:
        return not self._needs_block(self._table(seq_id)) or self.num_free_blocks > 0

    def append_slot(self, seq_id: int) -> tuple[int, tuple[int, int] | None]:
        table = self._table(seq_id)
        if not self.can_append(seq_id):
            raise RuntimeError(f"sequence {seq_id} needs a free block and none is left: "
                               "check can_append first")
        copy = None
        if table.num_tokens == len(table.blocks) * self.block_size:
            table.blocks.append(self._new_block())  # the last block is full: a fresh one
        elif self.ref_counts[table.blocks[-1]] > 1:  # others read it: write into a copy
            shared = table.blocks[-1]
            table.blocks[-1] = self._new_block()
            self._release(shared)
            copy = (shared, table.blocks[-1])
        position = table.num_tokens
        table.num_tokens += 1
        block = table.blocks[position // self.block_size]
        return block * self.block_size + position % self.block_size, copy

    # -- sharing and release --------------------------------------------------------------
    def fork(self, parent_id: int, child_id: int) -> None:
        parent = self._table(parent_id)
        if child_id in self.tables:
            raise ValueError(f"sequence {child_id} already holds blocks")
        for block in parent.blocks:
            self.ref_counts[block] += 1
        self.tables[child_id] = Table(list(parent.blocks), parent.num_tokens, list(parent.keys))

    def free(self, seq_id: int) -> None:
        table = self._table(seq_id)
        del self.tables[seq_id]
        for block in reversed(table.blocks):  # deepest first: a shared prefix outlives tails
            self._release(block)

    # -- inspection -----------------------------------------------------------------------
    def block_table(self, seq_id: int) -> list[int]:
        return list(self._table(seq_id).blocks)

    def num_tokens(self, seq_id: int) -> int:
        return self._table(seq_id).num_tokens
