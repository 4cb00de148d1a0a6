"""KV storage shared by many sequences, addressed by slot.

A slot is one token's row of K (and of V) in a layer: [kv_heads, head_dim]. The storage is one
flat run of slots per layer; how a sequence's positions map to slots is the whole difference
between memory layouts:

- paged: slot = block_table[position // block_size] * block_size + position % block_size, over
  a pool of shape [num_blocks, block_size, kv_heads, head_dim] (see block_manager.py);
- contiguous slabs: slot = slab_start + position (see contiguous_allocator.py).

``SequenceKV`` puts one sequence's mapping in front of the storage and gives the model the same
``store_and_fetch`` it uses with a per-sequence cache, so the model runs unchanged on any layout.
"""

from collections.abc import Callable

import torch


class KVStorage:
    """Per-layer K and V for num_slots tokens; paged pools view it as blocks of block_size."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 block_size: int = 1, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        if num_slots % block_size:
            raise ValueError(f"num_slots ({num_slots}) must be a multiple of block_size "
                             f"({block_size})")
        shape = (num_slots // block_size, block_size, num_kv_heads, head_dim)
        self.block_size = block_size
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def flat(self, cache: torch.Tensor) -> torch.Tensor:
        return cache.view(-1, *cache.shape[2:])  # [num_slots, kv_heads, head_dim], no copy

    # --8<-- [start:write]
    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Store new tokens' K/V [T, kv_heads, head_dim] at their slots [T]."""
        self.flat(self.k[layer])[slot_mapping] = k
        self.flat(self.v[layer])[slot_mapping] = v
    # --8<-- [end:write]

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.flat(self.k[layer])[slots], self.flat(self.v[layer])[slots]

    # --8<-- [start:copy_blocks]
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block dst becomes a copy of block src, in every layer."""
        if not pairs:
            return
        src, dst = (torch.tensor(x) for x in zip(*pairs, strict=True))
        for cache in (*self.k, *self.v):
            cache[dst] = cache[src]
    # --8<-- [end:copy_blocks]

    def fill_(self, value: float) -> None:
        """Overwrite every slot (tests poison unused slots with NaN)."""
        for cache in (*self.k, *self.v):
            cache.fill_(value)


def swap_blocks(src: KVStorage, dst: KVStorage, pairs: list[tuple[int, int]]) -> None:
    """Move whole blocks between two pools (GPU <-> CPU), every layer, K and V."""
    if not pairs:
        return
    s, d = (torch.tensor(x) for x in zip(*pairs, strict=True))
    for src_cache, dst_cache in zip((*src.k, *src.v), (*dst.k, *dst.v), strict=True):
        dst_cache[d] = src_cache[s.to(src_cache.device)].to(dst_cache.device)


# --8<-- [start:sequence_kv]
class SequenceKV:
    """One sequence's window onto shared storage: its positions -> slots mapping.

    New K/V go to slots_of(positions). Reading back positions [0, n) defaults to reading
    slots_of(range(n)); a layout with a faster path passes ``read`` (paged: gather whole blocks
    through the block table, as paged attention does).
    """

    def __init__(self, storage: KVStorage, slots_of: Callable[[list[int]], list[int]],
                 read: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]] | None = None):
        self.storage = storage
        self.slots_of = slots_of  # positions -> slots, e.g. through a block table
        self.read = read or (lambda layer, n: storage.read(layer, torch.tensor(slots_of(
            range(n)), device=storage.k[0].device)))
        self.num_cached_tokens = 0

    def split(self, num_rows: int):
        return [(slice(0, num_rows), self)]  # one sequence: every row is its

    def store_and_fetch(self, layer: int, positions: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        slots = torch.tensor(self.slots_of(positions.tolist()), device=k.device)
        self.storage.write(layer, slots, k, v)
        end = int(positions[-1]) + 1
        self.num_cached_tokens = max(self.num_cached_tokens, end)
        keys, values = self.read(layer, end)  # [end, kv_heads, head_dim] each
        return keys, values, torch.arange(end, device=k.device)
# --8<-- [end:sequence_kv]


# --8<-- [start:batch_kv]
class BatchKV:
    """The caches of a flat batch: the first n_0 rows are sequence 0's, the next n_1 are
    sequence 1's, ... Attention splits the batch with it; every other layer ignores it."""

    def __init__(self, parts: list[tuple[int, SequenceKV]]):
        self.parts = parts  # (number of rows, that sequence's cache), in row order

    def split(self, num_rows: int):
        assert num_rows == sum(n for n, _ in self.parts), "batch rows and caches disagree"
        out, start = [], 0
        for n, cache in self.parts:
            out.append((slice(start, start + n), cache))
            start += n
        return out
# --8<-- [end:batch_kv]
