"""What the KV pool holds, described per group of layers (vLLM V1's ``KVCacheSpec``).

A model's layers need not all cache the same thing. A full-attention layer keeps K and V for
every token; a sliding-window layer needs only the last W tokens'; a latent-attention (MLA) layer
keeps one compressed vector and a rotary key per token instead of K and V per head. vLLM V1
describes each kind by a *spec* (how many bytes one block of one layer takes, and which tokens
a layer still reads), gathers the layers of one kind into a *group*, and gives every group its
own block table over one shared pool of blocks.

pagedllm has one group today: full attention, or — when every layer slides over the same
window W (a Mistral checkpoint) — a sliding window, whose blocks that fall wholly out of the
window go back to the pool while the sequence runs (``SlidingWindowSpec``, and
``BlockSpaceManager.remove_skipped_blocks``). The structure is the one a second group (a model
mixing local and global layers) or a latent group joins.

The engine sizes the pool (``num_blocks``); each runner (each tensor-parallel rank) builds its
tensors from the config and its own spec (``ModelRunner.initialize_kv_cache``). Nothing here
touches a tensor.
"""

from dataclasses import dataclass, field

import torch

from ..ops.kv_quant import kv_cache_format


@dataclass(frozen=True)
class AttentionSpec:
    """K and V per token and KV head, in the layout ``cache_engine.py`` allocates."""

    block_size: int  # tokens per block
    num_kv_heads: int  # this rank's KV heads
    head_size: int
    dtype: torch.dtype  # the model's dtype (the pool's, unless kv_cache_dtype stores fewer bits)
    kv_cache_dtype: str = "auto"

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block of one layer takes: K and V, and their per-token scales if any."""
        fmt = kv_cache_format(self.kv_cache_dtype)
        per_token_head = fmt.bytes_per_token_head(self.head_size, self.dtype.itemsize)
        return 2 * self.block_size * self.num_kv_heads * per_token_head

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens whose K/V no token still to be computed reads (vLLM's
        ``get_num_skipped_tokens``): none, for full attention."""
        return 0

    def max_blocks_per_seq(self, num_tokens: int) -> int:
        """Blocks a decoding sequence of num_tokens tokens holds at most."""
        return -(-num_tokens // self.block_size)


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """Every token's K and V, kept until the sequence ends. sliding_window, where set, is what
    attention reads (the last W tokens), not what is kept: the pool keeps them all (a model
    whose layers slide over different windows, until such a model has a group per window)."""

    sliding_window: int | None = None


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    """Layers that attend to the last ``sliding_window`` tokens only: the query at position p
    reads the keys at positions p - W < k <= p (``ops/attention.py``'s mask). Once the next
    token to compute is at position c, the keys at positions <= c - W are read by nobody, so
    the blocks that hold only such keys go back to the pool (vLLM's SlidingWindowSpec)."""

    sliding_window: int = field(kw_only=True)

    def __post_init__(self) -> None:
        if isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int) \
                or self.sliding_window < 1:
            raise ValueError(f"sliding_window must be an integer >= 1, got "
                             f"{self.sliding_window!r}")

    # --8<-- [start:num_skipped_tokens]
    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """The next token is at position c = num_computed_tokens and reads keys > c - W:
        positions 0 .. c - W (c - W + 1 tokens) are never read again."""
        return max(0, num_computed_tokens - self.sliding_window + 1)
    # --8<-- [end:num_skipped_tokens]

    def max_blocks_per_seq(self, num_tokens: int) -> int:
        """A decode step reads W keys (the window, the new token's included) and writes the
        new token: W positions at any offset in their blocks span at most ceil(W / block_size)
        + 1 blocks, however long the sequence."""
        window_blocks = -(-self.sliding_window // self.block_size) + 1
        return min(super().max_blocks_per_seq(num_tokens), window_blocks)


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share one block table, and what each of them caches."""

    layer_ids: tuple[int, ...]
    kv_cache_spec: KVCacheSpec


@dataclass(frozen=True)
class KVCacheConfig:
    """The pool the engine decided on: how many blocks on the device and in the CPU swap
    space, and the groups of layers that hold a block table each.

    num_blocks counts the blocks the KV manager hands out. A pool with a sliding-window group
    has one block more, the *null block* (vLLM's ``null_block``): the placeholder a block table
    keeps where a block fell out of the window, so that positions stay aligned. It is never
    handed out and never written; its id is num_blocks (the row past the others) and its rows
    stay zero, so a kernel that reads it reads finite zeros, which the window's mask discards."""

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

    @property
    def null_block(self) -> int | None:
        """The null block's id, or None where no group frees blocks."""
        return self.num_blocks if uses_null_block(self.kv_cache_groups) else None

    @property
    def num_gpu_tensor_blocks(self) -> int:
        """Rows of the device tensors: the blocks handed out, and the null block if any."""
        return self.num_blocks + (self.null_block is not None)


def uses_null_block(kv_cache_groups) -> bool:
    """Does some group give blocks back before its sequence ends (and so need the null
    block to stand in for them)?"""
    return any(isinstance(g.kv_cache_spec, SlidingWindowSpec) for g in kv_cache_groups)
