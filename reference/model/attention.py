"""How a model layer reaches its keys and values: an attention context handed to the forward.

The model computes q, k, v for a flat batch of tokens and asks the context to attend. What the
context does with them is the whole difference between memory strategies, and the model never
needs to know which one runs:

- ``NoCache`` / ``ContiguousCache`` (``cache.py``): one sequence, the teaching loop of lesson 1;
- ``PagedAttention`` (below): the engine's step. Many sequences laid end to end, their K/V in a
  shared pool of blocks. The step's ``AttentionMetadata`` (slot mapping, block tables, sequence
  lengths, query offsets) is built once per step by the engine, so no layer asks anyone where a
  token lives: it writes the new K/V by slot and reads through the block tables.

Every context also carries the ``Backend`` whose ops (norms, rotary, activation) the layers use.
"""

from dataclasses import dataclass, field

import torch

from ..ops import REFERENCE_BACKEND, Backend
from ..ops.kv_quant import K_SCALE_CONSTANT, V_SCALE_CONSTANT, calculated_scale, kv_cache_format


# --8<-- [start:metadata]
@dataclass
class AttentionMetadata:
    """Where the step's tokens go and what each sequence's queries may read (vLLM's names).

    B sequences, T tokens in all:
    slot_mapping [T]             slot of each new token's K/V (-1: padding, not stored)
    block_tables [B, max_blocks] each sequence's physical blocks, int32, padded
    seq_lens [B]                 tokens in the cache per sequence once this step's are stored
    query_start_loc [B + 1]      sequence b's tokens are rows query_start_loc[b]:[b + 1]
    seq_lens_cpu, query_start_loc_cpu: host copies, for loop bounds without a device sync
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens_cpu: torch.Tensor
    query_start_loc_cpu: torch.Tensor
# --8<-- [end:metadata]


# --8<-- [start:quant]
@dataclass
class KVCacheQuant:
    """How the pool's values are stored (``ops/kv_quant.py``) and their scales, per layer.

    kv_cache_dtype "auto" has none. fp8: k_scales[layer], v_scales[layer] are [1] float32, 1.0
    or, with calculate_scales, set from the K/V of the first forward (the engine clears the flag
    once that forward has finished: a failed one leaves it set, so no layer keeps a scale from a
    batch that was thrown away). int8 / int4: [num_blocks, block_size, kv_heads] bfloat16 (int4:
    [..., 2], scale and zero), per slot and KV head, written by store_kv with the values. int4
    also has a rotation H: the context stores k H and v H, attends with q H (the scores are
    unchanged, H is orthogonal) and rotates the output back.
    """

    kv_cache_dtype: str = "auto"
    k_scales: list[torch.Tensor] = field(default_factory=list)
    v_scales: list[torch.Tensor] = field(default_factory=list)
    calculate_scales: bool = False
    rotation: torch.Tensor | None = None  # int4: the Hadamard matrix [head_dim, head_dim]

    @property
    def scales_per_tensor(self) -> bool:
        return kv_cache_format(self.kv_cache_dtype).scales == "per_tensor"

    def args(self, layer: int) -> tuple:
        """(kv_cache_dtype, k_scale, v_scale): the trailing arguments of store_kv and
        paged_attention for this layer."""
        if not self.k_scales:
            return (self.kv_cache_dtype, None, None)
        return (self.kv_cache_dtype, self.k_scales[layer], self.v_scales[layer])

    def calibrate(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """fp8's calculate_kv_scales: this layer's scales from the batch's real K/V rows."""
        self.k_scales[layer].copy_(calculated_scale(k, K_SCALE_CONSTANT))
        self.v_scales[layer].copy_(calculated_scale(v, V_SCALE_CONSTANT))
# --8<-- [end:quant]


# --8<-- [start:paged_context]
class PagedAttention:
    """The engine's attention context: store the step's K/V by slot, then paged attention."""

    def __init__(self, metadata: AttentionMetadata, k_caches: list[torch.Tensor],
                 v_caches: list[torch.Tensor], backend: Backend = REFERENCE_BACKEND,
                 quant: KVCacheQuant | None = None):
        self.metadata, self.k_caches, self.v_caches = metadata, k_caches, v_caches
        self.backend, self.quant = backend, quant or KVCacheQuant()

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the step's new K/V [T, kv_heads, head_dim] at their slots, as the pool stores
        them (quantized for a quantized kv_cache_dtype)."""
        md = self.metadata
        if self.quant.calculate_scales:
            real = md.slot_mapping >= 0  # [T]: padding rows must not set a scale
            self.quant.calibrate(layer, k[real], v[real])
        self.backend.store_kv(k, v, self.k_caches[layer], self.v_caches[layer], md.slot_mapping,
                              *self.quant.args(layer))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor, scale: float,
               sliding_window: int | None = None) -> torch.Tensor:
        """q [T, heads, head_dim], k and v [T, kv_heads, head_dim] -> [T, heads, head_dim]."""
        H = self.quant.rotation
        if H is not None:  # int4: a rotated row spreads a large channel over all of them
            q, k, v = (rotate(x, H) for x in (q, k, v))
        self.store(layer, k, v)
        out = self.read(layer, q, scale, sliding_window)  # [T, heads, head_dim]
        return out if H is None else rotate(out, H)  # H is its own inverse

    def read(self, layer: int, q: torch.Tensor, scale: float,
             sliding_window: int | None = None) -> torch.Tensor:
        """Paged attention of q over the layer's cache (this step's K/V already stored)."""
        md = self.metadata
        return self.backend.paged_attention(
            q, self.k_caches[layer], self.v_caches[layer], md.block_tables, md.seq_lens_cpu,
            md.query_start_loc_cpu, scale, sliding_window, *self.quant.args(layer))


def rotate(x: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] @ H, computed in float32, in x's dtype."""
    return (x.float() @ H).to(x.dtype)
# --8<-- [end:paged_context]
