"""What the KV pool holds, described per group of layers (vLLM V1's ``KVCacheSpec``).

A model's layers need not all cache the same thing. A full-attention layer keeps K and V for
every token; a sliding-window layer needs only the last W tokens'; a latent-attention (MLA) layer
keeps one compressed vector and a rotary key per token instead of K and V per head. vLLM V1
describes each kind by a *spec* (how many bytes one block of one layer takes, and which tokens
a layer still reads), gathers the layers of one kind into a *group*, and gives every group its
own block table over one shared pool of blocks.

A model whose layers are all of one kind has one group: full attention, or — when every layer
slides over the same window W (a Mistral checkpoint) — a sliding window, whose blocks that fall
wholly out of the window go back to the pool while the sequence runs (``SlidingWindowSpec``,
and ``BlockSpaceManager.remove_skipped_blocks``), or latent attention (``MLAAttentionSpec``:
one row a token and layer, the pool's "K" tensors, and no V). A model that mixes kinds (Gemma
3: five local layers with a window to one global layer) gets a group per kind, or several of
equal size (``group_layers``, vLLM's hybrid grouping): every group has its own block table over
the one pool, and a block id names one row in each of ``num_kv_tensors`` K (and V) tensors,
which the groups' layers share — layer i of every group uses tensor i. A block belongs to one
group at a time, so the rows never collide, and a token costs each group what that group keeps:
a windowed group at most its window, a full group every token.

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
    stores_values = True  # a V tensor beside K (not a dataclass field: no annotation)

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
    """Every token's K and V, kept until the sequence ends (also a windowed layer's in a
    layout that keeps every token, ``keep_every_token``: its window is then the attention
    mask's alone)."""


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


@dataclass(frozen=True)
class MLAAttentionSpec(AttentionSpec):
    """Multi-head latent attention (DeepSeek-V2/V3, ``ops/mla.py``): per token one row of
    kv_lora_rank + qk_rope_head_dim numbers (the latent c_kv and the rotated k_pe), shared by
    every head, and no V — head_size is that row's width, num_kv_heads 1. vLLM's
    MLAAttentionSpec. Stored in the model's dtype: the engine refuses a quantized
    kv_cache_dtype for it at the door (``engine/config.py``)."""

    stores_values = False  # the latent row serves as keys and values

    @property
    def page_size_bytes(self) -> int:
        """One block of one layer: block_size rows of the latent's width."""
        return self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec | MLAAttentionSpec


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share one block table, and what each of them caches."""

    layer_ids: tuple[int, ...]
    kv_cache_spec: KVCacheSpec


# --8<-- [start:group_layers]
def group_layers(layer_specs: list[KVCacheSpec]) -> tuple[KVCacheGroupSpec, ...]:
    """One group per kind of layer when every kind has as many layers; otherwise each kind is
    cut into groups of the smallest kind's size (vLLM's hybrid grouping): 12 layers, 10 local
    and 2 global (Gemma 3's 5 to 1), give 6 groups of 2 layers, 5 local and 1 global. Groups
    of (nearly) equal size share num_kv_tensors tensors, so a block costs the same in every
    group and the pool is one list of free blocks."""
    kinds: dict[KVCacheSpec, list[int]] = {}
    for layer, spec in enumerate(layer_specs):
        kinds.setdefault(spec, []).append(layer)
    pages = {spec.page_size_bytes for spec in kinds}
    if len(pages) > 1:
        raise ValueError(f"layers whose blocks differ in size ({sorted(pages)} bytes) cannot "
                         "share one pool of blocks; every kind of layer must cache as many "
                         "bytes a block")
    size = min(len(layers) for layers in kinds.values())
    groups = [KVCacheGroupSpec(tuple(layers[i:i + size]), spec)
              for spec, layers in kinds.items() for i in range(0, len(layers), size)]
    return tuple(sorted(groups, key=lambda g: g.layer_ids[0]))
# --8<-- [end:group_layers]


def keep_every_token(groups: tuple[KVCacheGroupSpec, ...]) -> tuple[KVCacheGroupSpec, ...]:
    """Every layer in one group that keeps every token (a windowed layer as full attention:
    its window is the attention mask's, not the pool's), for a layout whose sequences hold
    their memory to the end — the contiguous slab — so that each layer has its own tensor."""
    if len(groups) == 1 and not isinstance(groups[0].kv_cache_spec, SlidingWindowSpec):
        return groups
    spec = groups[0].kv_cache_spec
    full = FullAttentionSpec(spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype,
                             spec.kv_cache_dtype)
    layers = tuple(sorted(layer for g in groups for layer in g.layer_ids))
    return (KVCacheGroupSpec(layers, full),)


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
    def num_kv_tensors(self) -> int:
        """K (and V) tensors the pool allocates: as many as the largest group has layers,
        each shared by one layer of every group (one group: a tensor per layer)."""
        return max(len(g.layer_ids) for g in self.kv_cache_groups)

    def tensor_of_layer(self, layer: int) -> int:
        """Which of the num_kv_tensors tensors the layer reads and writes: its place in its
        group."""
        for group in self.kv_cache_groups:
            if layer in group.layer_ids:
                return group.layer_ids.index(layer)
        raise ValueError(f"layer {layer} is in no KV cache group")

    def group_of_layer(self, layer: int) -> int:
        """The KV cache group (and so the block table) of the layer."""
        for g, group in enumerate(self.kv_cache_groups):
            if layer in group.layer_ids:
                return g
        raise ValueError(f"layer {layer} is in no KV cache group")

    @property
    def bytes_per_block(self) -> int:
        """One block id across every tensor it names a row of: a block is one group's, and
        takes a row in each of the num_kv_tensors tensors (one group: every layer's)."""
        return self.num_kv_tensors * self.kv_cache_groups[0].kv_cache_spec.page_size_bytes

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
