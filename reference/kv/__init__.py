"""KV memory: the bookkeeping of who holds which slots, and the tensors that hold them.

Bookkeeping first and apart: the block manager (paged pool, reference counts, fork,
copy-on-write, swap), the prefix cache, the contiguous slab allocator, and the engine-facing
KV cache managers over either layout, and the specs of what the pool holds per group of
layers (full attention, or a sliding window that gives its blocks back); none of them
touches a tensor — where data must move they return block pairs. The cache engine owns the
tensors and carries those moves out before each forward. This package never imports the
model or the engine.
"""

from .block_manager import BlockPool, BlockSpaceManager, BlockTable
from .cache_engine import CacheEngine
from .contiguous_allocator import ContiguousAllocator
from .kv_cache_manager import ContiguousKVCacheManager, KVCacheBlocks, PagedKVCacheManager
from .kv_cache_spec import (
                            AttentionSpec,
                            FullAttentionSpec,
                            KVCacheConfig,
                            KVCacheGroupSpec,
                            MLAAttentionSpec,
                            SlidingWindowSpec,
                            group_layers,
                            keep_every_token,
)
from .prefix_cache import PrefixCache, block_key

__all__ = ["AttentionSpec", "BlockPool", "BlockSpaceManager", "BlockTable", "CacheEngine",
           "ContiguousAllocator", "ContiguousKVCacheManager", "FullAttentionSpec",
           "KVCacheBlocks", "KVCacheConfig", "KVCacheGroupSpec", "MLAAttentionSpec",
           "PagedKVCacheManager",
           "PrefixCache", "SlidingWindowSpec", "block_key", "group_layers",
           "keep_every_token"]
