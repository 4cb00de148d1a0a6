"""One sequence's latent KV cache: the attention context an MLA model (DeepSeek-V2) runs with
outside the engine, as ``cache.py``'s ContiguousCache is for the Llama family.

An MLA layer caches one row per token, ``c_kv ‖ k_pe`` (kv_lora_rank + qk_rope_head_dim
numbers), not per-head K and V, so it asks its context through a method of its own:

    attend_latent(layer, q_nope, q_pe, c_kv, k_pe, positions, w_uk, w_uv, scale) -> [T, H, V]

store the new tokens' rows, then attend over every row the queries may see, in one of the two
forms of ``ops/mla.py``: expanded (decompress the latents through kv_b_proj into per-head K and
V: a prompt, where every key meets many queries) or absorbed (W_UK folded into the query, W_UV
applied after attending over the latents: a decode, which reads each cached row once for all
heads). Both give the same result; ``form`` forces one, for tests and comparisons.

The engine's paged context implements the same method: ``store_latent`` by the step's slot
mapping into a ``[num_blocks, block_size, R + P]`` tensor per layer, then the absorbed
``paged_mla_attention`` for decode rows (and the expanded form over the gathered latents for
prompt rows).
"""

from collections import Counter

import torch

from ..ops import REFERENCE_BACKEND
from ..ops.mla import mla_absorbed_attention, mla_expanded_attention
from .config import ModelConfig

FORMS = ("auto", "expanded", "absorbed")


# --8<-- [start:contiguous_latent_cache]
class ContiguousLatentCache:
    """One sequence's rows c_kv ‖ k_pe in a slab reserved for max_len tokens, every layer.

    form: "auto" (expanded for several new tokens, absorbed for one: vLLM's split between
    prefill and decode), "expanded" or "absorbed" for every call. ``forms_used`` counts the
    layer calls each form served."""

    # the ops the model's layers use (norms, activation)
    backend = REFERENCE_BACKEND

    def __init__(self, num_layers: int, max_len: int, kv_lora_rank: int, qk_rope_head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 form: str = "auto"):
        if form not in FORMS:
            raise ValueError(f"form {form!r} is unknown; choose one of {', '.join(FORMS)}")
        self.kv_lora_rank, self.form = kv_lora_rank, form
        # [layers, max_len, R + P]: a row per token, the layout of one paged slot
        self.kv = torch.zeros(num_layers, max_len, kv_lora_rank + qk_rope_head_dim,
                              dtype=dtype, device=device)
        self.max_len = max_len
        self.num_cached_tokens = 0  # positions [0, num_cached_tokens) hold valid rows
        self.forms_used: Counter = Counter()

    @classmethod
    def for_config(cls, cfg: ModelConfig, max_len: int, dtype: torch.dtype | None = None,
                   device: str | torch.device = "cpu", form: str = "auto"):
        """The cache of an MLA model's config (dtype: the checkpoint's unless given)."""
        return cls(cfg.num_layers, max_len, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
                   dtype or cfg.dtype, device, form)

    def store_and_fetch(
        self, layer: int, positions: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store c_kv [T, R] and k_pe [T, P] at positions [T]; return every row the new queries
        may see, c_kv [S, R], k_pe [S, P], and their positions [S] (S = last position + 1)."""
        end = int(positions[-1]) + 1
        if end > self.max_len:
            raise ValueError(f"position {end - 1} does not fit a cache reserved for "
                             f"{self.max_len} tokens; reserve max_len >= {end}")
        self.kv[layer, positions] = torch.cat([c_kv, k_pe], dim=-1).to(self.kv.dtype)
        self.num_cached_tokens = max(self.num_cached_tokens, end)
        rows = self.kv[layer, :end]  # [S, R + P]
        key_positions = torch.arange(end, device=rows.device)
        return rows[:, :self.kv_lora_rank], rows[:, self.kv_lora_rank:], key_positions

    def attend_latent(self, layer: int, q_nope: torch.Tensor, q_pe: torch.Tensor,
                      c_kv: torch.Tensor, k_pe: torch.Tensor, positions: torch.Tensor,
                      w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float) -> torch.Tensor:
        """q_nope [T, H, N], q_pe [T, H, P] (rotated), c_kv [T, R] (normalized), k_pe [T, P]
        (rotated), positions [T]; w_uk [H, N, R], w_uv [H, R, V]: kv_b_proj split per head.
        Returns [T, H, V], attention's output before o_proj."""
        keys_c, keys_pe, key_positions = self.store_and_fetch(layer, positions, c_kv, k_pe)
        form = self.form
        if form == "auto":
            form = "absorbed" if q_nope.shape[0] == 1 else "expanded"
        self.forms_used[form] += 1
        attend = mla_absorbed_attention if form == "absorbed" else mla_expanded_attention
        return attend(q_nope, q_pe, keys_c, keys_pe, w_uk, w_uv, positions, key_positions,
                      scale)  # [T, H, V]
# --8<-- [end:contiguous_latent_cache]

    def nbytes(self) -> int:
        """Bytes reserved: (R + P) numbers a token and layer, against 2 * kv_heads * head_dim
        for a per-head K/V cache."""
        return self.kv.nbytes
