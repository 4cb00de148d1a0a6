"""The engine's KV memory: bookkeeping (which slots a sequence owns) plus the storage itself.

Two layouts behind the same verbs, so one scheduler drives either:

- ``PagedKVCache``: a BlockSpaceManager over a block pool (and a CPU pool to swap to). A
  sequence takes blocks for its current tokens and one more whenever its last block fills.
- ``ContiguousKVCache``: a ContiguousAllocator over one linear space. A sequence reserves, at
  admission, a slab for everything it may ever hold (policy max / pow2 / oracle); it never needs
  more, so it never waits for memory once running, but the reservation is paid up front.

Verbs: can_admit / admit (a waiting group's tokens), can_append / append (a slot for the token
each running sequence computes next), free, swap_out / swap_in (paged only), view (the
sequence's SequenceKV, which the model writes and reads through).
"""

import torch

from .block_manager import BlockSpaceManager
from .contiguous_allocator import ContiguousAllocator
from .kv_storage import KVStorage, SequenceKV, swap_blocks
from .paged_attention import gather_kv
from .sequence import Sequence, SequenceGroup

WATERMARK = 0.01  # admission leaves 1 % of the blocks free, as vLLM does, so that a request just
# admitted is not preempted at its first decode step


class PagedKVCache:
    def __init__(self, cfg, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int,
                 dtype: torch.dtype, device: str | torch.device,
                 enable_prefix_caching: bool = False):
        self.manager = BlockSpaceManager(block_size, num_gpu_blocks, num_cpu_blocks,
                                         enable_prefix_caching)
        self.block_size = block_size
        shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        self.gpu = KVStorage(shape[0], num_gpu_blocks * block_size, *shape[1:], block_size,
                             dtype, device)
        self.cpu = KVStorage(shape[0], num_cpu_blocks * block_size, *shape[1:], block_size,
                             dtype, "cpu")
        self.watermark_blocks = int(WATERMARK * num_gpu_blocks)
        self.num_swapped_blocks = 0
        self.num_cow_copies = 0

    @property
    def num_total_blocks(self) -> int:
        return self.manager.gpu.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.manager.num_free_gpu_blocks

    def never_fits(self, num_tokens: int, copies: int = 1) -> bool:
        return copies * self.manager.blocks_needed(num_tokens) > self.num_total_blocks

    # --8<-- [start:can_admit]
    def can_admit(self, group: SequenceGroup) -> bool:
        needed = sum(self.manager.num_new_blocks(len(s), s.token_ids)
                     for s in group.unfinished_seqs())
        return self.num_free_blocks - needed >= min(self.watermark_blocks,
                                                    self.num_total_blocks - needed)
    # --8<-- [end:can_admit]

    # --8<-- [start:admit]
    def admit(self, group: SequenceGroup) -> None:
        for seq in group.unfinished_seqs():
            self.manager.allocate(seq.seq_id, len(seq), seq.token_ids)
            # tokens found in the prefix cache need no prefill
            seq.num_computed_tokens = self.manager.tables[seq.seq_id].num_cached_tokens
    # --8<-- [end:admit]

    def mark_computed(self, seq: Sequence) -> None:
        self.manager.mark_computed(seq.seq_id, seq.token_ids, seq.num_computed_tokens)

    def can_append(self, group: SequenceGroup) -> bool:
        """Blocks for one more token per sequence: a fresh block where the last is full; a copy
        where it is shared — except for the last of the group's sharers to write, when nobody
        outside the group holds the block (by then it owns the block alone)."""
        needed = 0
        sharers: dict[int, int] = {}
        for seq in group.unfinished_seqs():
            if not self.manager.append_needs_block(seq.seq_id):
                continue
            table = self.manager.tables[seq.seq_id]
            if table.num_tokens == len(table.blocks) * self.block_size:
                needed += 1  # last block full
            else:
                sharers[table.blocks[-1]] = sharers.get(table.blocks[-1], 0) + 1
        for block, count in sharers.items():
            outside = self.manager.gpu.ref_counts[block] > count
            needed += count if outside else count - 1
        return needed <= self.num_free_blocks

    # --8<-- [start:append]
    def append(self, seq: Sequence) -> None:
        """A slot for the newest token, whose K/V this step computes."""
        _, copy = self.manager.append_slot(seq.seq_id)
        if copy:  # copy-on-write of a shared last block (parallel sampling, beam search)
            self.gpu.copy_blocks([copy])
            self.num_cow_copies += 1
    # --8<-- [end:append]

    def free(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            self.free_seq(seq)

    def free_seq(self, seq: Sequence) -> None:
        if seq.seq_id in self.manager.tables:
            self.manager.free(seq.seq_id)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent (parallel sampling): nothing is copied
        until one of them writes into a shared block."""
        self.manager.fork(parent.seq_id, child.seq_id)

    def can_swap_out(self, group: SequenceGroup) -> bool:
        return self.manager.can_swap_out([s.seq_id for s in group.unfinished_seqs()])

    def swap_out(self, group: SequenceGroup) -> None:
        pairs = self.manager.swap_out([s.seq_id for s in group.unfinished_seqs()])
        swap_blocks(self.gpu, self.cpu, pairs)
        self.num_swapped_blocks += len(pairs)

    def can_swap_in(self, group: SequenceGroup) -> bool:
        return self.manager.can_swap_in([s.seq_id for s in group.unfinished_seqs()])

    def swap_in(self, group: SequenceGroup) -> None:
        pairs = self.manager.swap_in([s.seq_id for s in group.unfinished_seqs()])
        swap_blocks(self.cpu, self.gpu, pairs)
        self.num_swapped_blocks -= len(pairs)

    def view(self, seq: Sequence) -> SequenceKV:
        table = self.manager.tables[seq.seq_id]
        return SequenceKV(
            self.gpu, slots_of=lambda pos: self.manager.slot_mapping(seq.seq_id, pos),
            read=lambda layer, n: (gather_kv(self.gpu.k[layer], table.blocks, n),
                                   gather_kv(self.gpu.v[layer], table.blocks, n)))


class ContiguousKVCache:
    def __init__(self, cfg, num_slots: int, policy: str, max_model_len: int,
                 dtype: torch.dtype, device: str | torch.device):
        self.allocator = ContiguousAllocator(num_slots, policy, max_model_len)
        self.storage = KVStorage(cfg.num_layers, num_slots, cfg.num_kv_heads, cfg.head_dim,
                                 dtype=dtype, device=device)
        self.max_model_len = max_model_len
        self.block_size = 1  # stats count slots as blocks of one
        self.num_swapped_blocks = 0
        self.num_cow_copies = 0  # slabs are never shared

    @property
    def num_total_blocks(self) -> int:
        return self.allocator.total_slots

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.total_slots - sum(s.length for s in self.allocator.slabs)

    def _lengths(self, group: SequenceGroup, seq: Sequence) -> tuple[int, int]:
        """(tokens it holds now, tokens it may still add) — the slab must cover both."""
        remaining = group.sampling_params.max_tokens - len(seq.output_token_ids)
        return len(seq), max(1, min(remaining, self.max_model_len - len(seq)))

    def never_fits(self, num_tokens: int, copies: int = 1) -> bool:
        return min(num_tokens, self.max_model_len) > self.allocator.total_slots or (
            self.allocator.policy == "max" and self.max_model_len > self.allocator.total_slots)

    def can_admit(self, group: SequenceGroup) -> bool:
        return all(self.allocator.can_allocate(*self._lengths(group, s))
                   for s in group.unfinished_seqs())

    def admit(self, group: SequenceGroup) -> None:
        for seq in group.unfinished_seqs():
            self.allocator.allocate(seq.seq_id, *self._lengths(group, seq))

    def mark_computed(self, seq: Sequence) -> None:
        pass  # slabs are never shared, so there is nothing to look up later

    def can_append(self, group: SequenceGroup) -> bool:
        return True  # the slab was reserved for every token the request may produce

    def append(self, seq: Sequence) -> None:
        self.allocator.append_slot(seq.seq_id)

    def free(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            self.free_seq(seq)

    def free_seq(self, seq: Sequence) -> None:
        if self.allocator.holds(seq.seq_id):
            self.allocator.free(seq.seq_id)

    def view(self, seq: Sequence) -> SequenceKV:
        start, _ = self.allocator.slab(seq.seq_id)
        return SequenceKV(
            self.storage, slots_of=lambda pos: [start + p for p in pos],
            read=lambda layer, n: (self.storage.flat(self.storage.k[layer])[start: start + n],
                                   self.storage.flat(self.storage.v[layer])[start: start + n]))
