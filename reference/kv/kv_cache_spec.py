"""What the KV pool holds, described per group of layers (vLLM V1's ``KVCacheSpec``).

A model's layers need not all cache the same thing. A full-attention layer keeps K and V for
every token; a sliding-window layer needs only the last W tokens'; a latent-attention (MLA) layer
keeps one compressed vector and a rotary key per token instead of K and V per head. vLLM V1
describes each kind by a *spec* (how many bytes one block of one layer takes, and which tokens
a layer still reads), gathers the layers of one kind into a *group*, and gives every group its
own block table over one shared pool of blocks.

pagedllm has one group today, full attention over every layer: the windowed layers of a
Mistral checkpoint are kept whole (``sliding_window`` is recorded: attention reads only the
window, but no block is given back before the sequence ends — as vLLM does when its hybrid
allocator is off). The structure is the one a sliding-window group or a latent group joins.

The engine sizes the pool (``num_blocks``); each runner (each tensor-parallel rank) builds its
tensors from the config and its own spec (``ModelRunner.initialize_kv_cache``). Nothing here
touches a tensor.
"""

from dataclasses import dataclass

import torch

from ..ops.kv_quant import kv_cache_format


@dataclass(frozen=True)
class FullAttentionSpec:
    """K and V of every token, per KV head, in the layout ``cache_engine.py`` allocates."""

    block_size: int  # tokens per block
    num_kv_heads: int  # this rank's KV heads
    head_size: int
    dtype: torch.dtype  # the model's dtype (the pool's, unless kv_cache_dtype stores fewer bits)
    kv_cache_dtype: str = "auto"
    sliding_window: int | None = None  # attention reads the last W tokens; all are kept

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block of one layer takes: K and V, and their per-token scales if any."""
        fmt = kv_cache_format(self.kv_cache_dtype)
        per_token_head = fmt.bytes_per_token_head(self.head_size, self.dtype.itemsize)
        return 2 * self.block_size * self.num_kv_heads * per_token_head


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share one block table, and what each of them caches."""

    layer_ids: tuple[int, ...]
    kv_cache_spec: FullAttentionSpec


@dataclass(frozen=True)
class KVCacheConfig:
    """The pool the engine decided on: how many blocks on the device and in the CPU swap
    space, and the groups of layers that hold a block table each."""

    num_blocks: int
    num_cpu_blocks: int
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]

    @property
    def block_size(self) -> int:
        return self.kv_cache_groups[0].kv_cache_spec.block_size

    @property
    def num_layers(self) -> int:
        return sum(len(g.layer_ids) for g in self.kv_cache_groups)

    @property
    def bytes_per_block(self) -> int:
        """One block across every layer (a block id names the same rows in every layer)."""
        return sum(len(g.layer_ids) * g.kv_cache_spec.page_size_bytes
                   for g in self.kv_cache_groups)
