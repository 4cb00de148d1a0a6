"""Multi-head latent attention (MLA, DeepSeek-V2/V3): the readable definitions, vLLM's names.

What a layer caches
-------------------
An MLA layer projects each token's hidden state down to one small latent,
``kv_a_proj_with_mqa(x) = [c_kv | k_pe]``: ``c_kv`` [kv_lora_rank] (R), RMS-normalized, carries
every head's content, and ``k_pe`` [qk_rope_head_dim] (P), rotated, carries position and is
shared by all heads. ``kv_b_proj`` [H * (N + V), R] maps c_kv back up to each head's
``k_nope`` [N = qk_nope_head_dim] and ``v`` [V = v_head_dim]; head h's key is
``k_nope_h ‖ k_pe``. Both halves of that key, and the value, are functions of the R + P numbers
of ``c_kv ‖ k_pe``: so that row is all the cache keeps, one "head" of R + P per token and layer,
instead of H * (N + P) keys and H * V values.

The two forms of the same attention
-----------------------------------
Split kv_b_proj per head into W_UK [H, N, R] and W_UV [H, R, V] (vLLM's ``W_UK_T`` and
``W_UV``): ``k_nope_h = W_UK_h c_kv`` and ``v_h = c_kv W_UV_h``.

- Expanded (``mla_expanded_attention``): decompress every cached latent into per-head K and V,
  then ordinary attention with head dim N + P for scores and V for values. What the model was
  trained as; vLLM's ``forward_mha``.
- Absorbed (``mla_absorbed_attention``): never build K or V. The score of head h is
  ``q_nope_h · (W_UK_h c_kv) + q_pe_h · k_pe = (W_UK_hᵀ q_nope_h) · c_kv + q_pe_h · k_pe``, so
  the query is moved into the latent space once, ``q_latent = W_UK_hᵀ q_nope_h`` [R]
  (``absorb_query``), and scored against the cached rows as they are. The output is
  ``Σ_s p_s (c_kv_s W_UV_h) = (Σ_s p_s c_kv_s) W_UV_h``: attend over the latents,
  ``out_latent`` [R], and project up once (``unabsorb_output``). Matrix products are
  associative, so both forms compute the same numbers (up to rounding); vLLM's
  ``forward_mqa``.

Why decode takes the absorbed form: a decode step is memory-bound, one query reading its whole
context. Absorbed, every cached token costs one read of R + P numbers, shared by all H heads (the
layer is multi-query attention in the latent space, one "KV head"), and the values are the same
c_kv the scores just read. Expanded, each cached token needs H * (N + P + V) numbers, either
stored (the cache MLA exists to avoid: DeepSeek-V2, 128 heads of 128 + 64 and 128, stores
40,960 numbers a token and layer against 576 for the latent, 71 times fewer) or recomputed from
the latent every step (H * R * (N + V) multiply-adds per cached token, per step). The
absorption itself costs H * R * (N + V) per *query*, not per cached token.

Why prefill takes the expanded form: a prompt is compute-bound, as many queries as keys. The
latent form multiplies in R + P (576) dimensions for every score and R (512) for every output,
the expanded one in N + P (192) and V (128): about three times the arithmetic per query-key pair.
Decompressing each key once and attending in the small head dims is cheaper when every key is
read by many queries.

The paged cache (``paged_mla_attention``, ``store_latent``): one tensor per layer,
``[num_blocks, block_size, R + P]``, each slot the row ``c_kv ‖ k_pe``; the same block tables,
slot mappings and query layout as ``attention.py``'s paged attention.
"""

import torch

from .attention import gather_kv


# --8<-- [start:rotary_interleaved]
def rotary_interleaved(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                       inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's rotary layout: features (2i, 2i + 1) are the pair rotated by frequency i
    (GPT-J's interleaved pairs, vLLM's ``is_neox_style=False``), not Llama's halves (i, i + d/2).
    Computed in float32 as transformers does (a complex product), returned in each input's
    dtype. q [T, heads, P], k [T, kv_heads, P] (MLA: one shared k_pe head), positions [T]."""
    angles = positions[:, None].float() * inv_freq.to(positions.device)[None, :]  # [T, P/2]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]  # [T, 1, P/2]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        pairs = x.float().unflatten(-1, (-1, 2))  # [T, heads, P/2, 2]
        even, odd = pairs[..., 0], pairs[..., 1]
        rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
        return rotated.flatten(-2).to(x.dtype)  # [T, heads, P]

    return rotate(q), rotate(k)
# --8<-- [end:rotary_interleaved]


# --8<-- [start:forms]
def expand_kv(c_kv: torch.Tensor, k_pe: torch.Tensor, w_uk: torch.Tensor,
              w_uv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Decompress latents into per-head keys and values: c_kv [S, R], k_pe [S, P], W_UK
    [H, N, R], W_UV [H, R, V] -> k [S, H, N + P] (k_nope ‖ the shared k_pe), v [S, H, V]."""
    k_nope = torch.einsum("sr,hnr->shn", c_kv, w_uk)  # [S, H, N]
    v = torch.einsum("sr,hrv->shv", c_kv, w_uv)  # [S, H, V]
    k_pe = k_pe[:, None, :].expand(-1, w_uk.shape[0], -1)  # [S, H, P]: a view, no copy
    return torch.cat([k_nope, k_pe], dim=-1), v


def _attend(scores: torch.Tensor, values: torch.Tensor, q_positions: torch.Tensor,
            k_positions: torch.Tensor) -> torch.Tensor:
    """Causal softmax of scores [H, T, S] (in float32), times values [S, H, D] -> [T, H, D]."""
    visible = k_positions[None, :] <= q_positions[:, None]  # [T, S]
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)  # [H, T, S]
    return torch.einsum("hts,shd->thd", probs, values)


def mla_expanded_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor,
                           k_pe: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
                           q_positions: torch.Tensor, k_positions: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """The prefill form: decompress, then causal attention per head.

    q_nope [T, H, N], q_pe [T, H, P] (rotated); c_kv [S, R] (normalized), k_pe [S, P]
    (rotated) of the keys the queries may see; q_positions [T], k_positions [S].
    Returns [T, H, V], the input of o_proj."""
    k, v = expand_kv(c_kv, k_pe, w_uk, w_uv)  # [S, H, N + P], [S, H, V]
    q = torch.cat([q_nope, q_pe], dim=-1)  # [T, H, N + P]
    scores = torch.einsum("thd,shd->hts", q, k) * scale  # [H, T, S]
    return _attend(scores, v, q_positions, k_positions)


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_nope [T, H, N] into the latent space: q_latent [T, H, R] = W_UK_hᵀ q_nope_h."""
    return torch.einsum("thn,hnr->thr", q_nope, w_uk)


def unabsorb_output(out_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """out_latent [T, H, R] up to each head's value space: [T, H, V] = out_latent_h W_UV_h."""
    return torch.einsum("thr,hrv->thv", out_latent, w_uv)


def latent_attention(q_latent: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor,
                     k_pe: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Attention in the latent space, one sequence: scores = (q_latent · c_kv + q_pe · k_pe)
    * scale, out_latent = softmax · c_kv (c_kv is both key and value).

    q_latent [T, H, R], q_pe [T, H, P]; c_kv [S, R], k_pe [S, P]. Returns [T, H, R]."""
    scores = (torch.einsum("thr,sr->hts", q_latent, c_kv)
              + torch.einsum("thp,sp->hts", q_pe, k_pe)) * scale  # [H, T, S]
    H = q_latent.shape[1]
    return _attend(scores, c_kv[:, None, :].expand(-1, H, -1), q_positions, k_positions)


def mla_absorbed_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor,
                           k_pe: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
                           q_positions: torch.Tensor, k_positions: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """The decode form: the same arguments and result as ``mla_expanded_attention``, with W_UK
    absorbed into the query and W_UV applied after attending over the latents."""
    q_latent = absorb_query(q_nope, w_uk)  # [T, H, R]
    out_latent = latent_attention(q_latent, q_pe, c_kv, k_pe, q_positions, k_positions, scale)
    return unabsorb_output(out_latent, w_uv)  # [T, H, V]
# --8<-- [end:forms]


# --8<-- [start:store_latent]
def store_latent(c_kv: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Write the step's rows c_kv [T, R] ‖ k_pe [T, P] at their slots [T] of kv_cache
    [num_blocks, block_size, R + P] (vLLM's concat_and_cache_mla). Slot -1: padding, not
    stored."""
    keep = slot_mapping >= 0  # [T]
    rows = torch.cat([c_kv, k_pe], dim=-1)[keep]  # [kept, R + P]
    kv_cache.view(-1, kv_cache.shape[-1])[slot_mapping[keep]] = rows.to(kv_cache.dtype)
# --8<-- [end:store_latent]


# --8<-- [start:paged_mla_attention]
def paged_mla_attention(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, scale: float) -> torch.Tensor:
    """The absorbed form over the paged latent cache, for a flat batch of queries.

    q_latent [T, H, R] (``absorb_query``), q_pe [T, H, P] (rotated); kv_cache
    [num_blocks, block_size, R + P] with this step's rows already stored (``store_latent``);
    block_tables [B, max_blocks] int32 (padding entries are never read); seq_lens [B] tokens in
    the cache per sequence, this step's included; query_start_loc [B + 1]. As in
    ``paged_attention``, sequence b's rows are its last q_len tokens: row i sits at position
    seq_len - q_len + i and reads the keys at positions <= its own (a decode: all of them).
    Returns out_latent [T, H, R] (``unabsorb_output`` takes it to [T, H, V]); rows past
    query_start_loc[B] (padding) are 0. seq_lens and query_start_loc give loop bounds: pass
    them on the CPU.
    """
    R = q_latent.shape[-1]
    out = torch.zeros_like(q_latent)  # [T, H, R]
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        rows = slice(starts[b], starts[b + 1])
        q_len = starts[b + 1] - starts[b]
        latents = gather_kv(kv_cache, block_tables[b], seq_len)  # [seq_len, R + P]
        k_positions = torch.arange(seq_len, device=q_latent.device)
        q_positions = k_positions[seq_len - q_len:]  # the queries are the last q_len tokens
        out[rows] = latent_attention(q_latent[rows], q_pe[rows], latents[:, :R],
                                     latents[:, R:], q_positions, k_positions, scale)
    return out
# --8<-- [end:paged_mla_attention]
