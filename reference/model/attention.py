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

from dataclasses import dataclass

import torch

from ..ops import REFERENCE_BACKEND, Backend, gather_kv
from ..ops.kv_quant import KVCacheQuant
from ..ops.mla import absorb_query, mla_expanded_attention, unabsorb_output


# --8<-- [start:metadata]
@dataclass
class AttentionMetadata:
    """Where the step's tokens go and what each sequence's queries may read (vLLM's
    names).

    B sequences, T tokens in all:
    slot_mapping [T]             slot of each new token's K/V (-1: padding, not stored)
    block_tables [B, max_blocks] each sequence's physical blocks, int32, padded
    seq_lens [B]                 tokens in the cache per sequence, this step's included
    query_start_loc [B + 1]      sequence b's tokens are rows query_start_loc[b]:[b + 1]
    seq_lens_cpu, query_start_loc_cpu: host copies, for loop bounds without a device
    sync
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens_cpu: torch.Tensor
    query_start_loc_cpu: torch.Tensor
# --8<-- [end:metadata]




# --8<-- [start:paged_context]
def rotate(x: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] @ H, computed in float32, in x's dtype."""
    return (x.float() @ H).to(x.dtype)


class PagedAttention:
    """The engine's attention context: store the step's K/V by slot, then paged
    attention."""

    def __init__(self, metadata: AttentionMetadata, k_caches: list[torch.Tensor],
                 v_caches: list[torch.Tensor], backend: Backend = REFERENCE_BACKEND,
                 quant: KVCacheQuant | None = None,
                 layer_metadata: list[AttentionMetadata] | None = None):
        """layer_metadata: a model with several KV cache groups gives each layer its
        group's metadata (its block tables and slots); None: every layer reads
        metadata."""
        self.metadata, self.k_caches, self.v_caches = metadata, k_caches, v_caches
        self.backend, self.quant = backend, quant or KVCacheQuant()
        self.layer_metadata = layer_metadata

    def metadata_of(self, layer: int) -> AttentionMetadata:
        """The block tables and slots this layer's KV cache group reads and writes."""
        if self.layer_metadata is None:
            return self.metadata
        return self.layer_metadata[layer]

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the step's new K/V [T, kv_heads, head_dim] at their slots, as the pool
        stores them (quantized for a quantized kv_cache_dtype)."""
        md = self.metadata_of(layer)
        if self.quant.calculate_scales:
            real = md.slot_mapping >= 0  # [T]: padding rows must not set a scale
            self.quant.calibrate(layer, k[real], v[real])
        self.backend.store_kv(k, v, self.k_caches[layer], self.v_caches[layer],
                              md.slot_mapping, *self.quant.args(layer))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor, scale: float,
               sliding_window: int | None = None) -> torch.Tensor:
        """q [T, heads, head_dim], k and v [T, kv_heads, head_dim]
        -> [T, heads, head_dim]."""
        H = self.quant.rotation
        # int4: a rotated row spreads a large channel over all of them
        if H is not None:
            q, k, v = (rotate(x, H) for x in (q, k, v))
        self.store(layer, k, v)
        out = self.read(layer, q, scale, sliding_window)  # [T, heads, head_dim]
        return out if H is None else rotate(out, H)  # H is its own inverse

    def read(self, layer: int, q: torch.Tensor, scale: float,
             sliding_window: int | None = None) -> torch.Tensor:
        """Paged attention of q over the layer's cache (this step's K/V already
        stored)."""
        md = self.metadata_of(layer)
        return self.backend.paged_attention(
            q, self.k_caches[layer], self.v_caches[layer], md.block_tables,
            md.seq_lens_cpu, md.query_start_loc_cpu, scale, sliding_window,
            *self.quant.args(layer))
    # --8<-- [end:paged_context]

    # --8<-- [start:attend_latent]
    # --8<-- [start:absorbed_decode]
    def attend_latent(self, layer: int, q_nope: torch.Tensor, q_pe: torch.Tensor,
                      c_kv: torch.Tensor, k_pe: torch.Tensor, positions: torch.Tensor,
                      w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float) -> torch.Tensor:
        """Multi-head latent attention over the paged latent cache (``ops/mla.py``): store
        the step's rows c_kv [T, R] and k_pe [T, P], then each decode (one query row) in
        the absorbed form, reading each cached row once for every head, and each prompt or
        chunk in the expanded form over its gathered latents (vLLM's split). q_nope
        [T, H, N], q_pe [T, H, P] -> [T, H, V]."""
        md = self.metadata_of(layer)
        cache = self.k_caches[layer].flatten(2)  # [num_blocks, block_size, R + P]
        self.backend.store_latent(c_kv, k_pe, cache, md.slot_mapping)
        starts, device = md.query_start_loc_cpu, q_nope.device
        q_lens = starts[1:] - starts[:-1]  # [B]
        out = q_nope.new_zeros(*q_nope.shape[:2], w_uv.shape[-1])  # [T, H, V]
        decodes = (q_lens == 1).nonzero()[:, 0]  # [D]
        if decodes.numel():
            rows = starts[decodes].to(device)  # [D]: each decode's one row
            seqs = decodes.to(device)
            one_each = torch.arange(decodes.numel() + 1, dtype=torch.int32, device=device)
            out_latent = self.backend.paged_mla_attention(
                absorb_query(q_nope[rows], w_uk), q_pe[rows], cache, md.block_tables[seqs],
                md.seq_lens[seqs], one_each, scale)  # [D, H, R]
            out[rows] = unabsorb_output(out_latent, w_uv)
        # --8<-- [end:absorbed_decode]
        R = c_kv.shape[-1]
        for b in (q_lens > 1).nonzero()[:, 0].tolist():  # prompts and chunks
            first, end, seq_len = int(starts[b]), int(starts[b + 1]), int(md.seq_lens_cpu[b])
            latents = gather_kv(cache, md.block_tables[b], seq_len)  # [seq_len, R + P]
            out[first:end] = mla_expanded_attention(
                q_nope[first:end], q_pe[first:end], latents[:, :R], latents[:, R:], w_uk,
                w_uv, positions[first:end], torch.arange(seq_len, device=device), scale)
        return out
    # --8<-- [end:attend_latent]
