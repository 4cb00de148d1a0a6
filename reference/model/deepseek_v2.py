"""DeepSeek-V2 with dense MLPs (transformers' DeepseekV2ForCausalLM, model_type "deepseek_v2").

The decoder is Llama's (RMSNorm before each sublayer, SwiGLU MLP, an untied or tied LM head)
except for its attention, multi-head latent attention (MLA). Per token, a layer computes:

- the query, from the hidden state (``q_proj``) or through a low-rank bottleneck when
  ``q_lora_rank`` is set (``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``), split per head
  into ``q_nope`` [qk_nope_head_dim] and ``q_pe`` [qk_rope_head_dim];
- one latent for keys and values, ``kv_a_proj_with_mqa(x) = [c_kv | k_pe]``: ``c_kv``
  [kv_lora_rank], normalized by ``kv_a_layernorm``, and ``k_pe`` [qk_rope_head_dim], one rotary
  head shared by all query heads;
- RoPE on q_pe and k_pe only, in DeepSeek's *interleaved* layout: transformers rotates features
  (2i, 2i + 1) as one complex number (``apply_rotary_emb``), not Llama's halves (i, i + d/2);
- ``kv_b_proj`` decompresses c_kv into each head's ``k_nope`` [qk_nope_head_dim] and ``v``
  [v_head_dim]; a head's key is ``k_nope ‖ k_pe``, scores are scaled by
  ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``.

What is cached is therefore c_kv ‖ k_pe: kv_lora_rank + qk_rope_head_dim numbers per token and
layer, one "head", instead of every head's K and V (``mla_kv_bytes_per_token`` counts both).
How attention runs over that cache, the expanded or the absorbed form, is the attention
context's choice (``reference/ops/mla.py`` explains both); the layer hands it the latents and
the two halves of kv_b_proj through one call:

    attn.attend_latent(layer, q_nope, q_pe, c_kv, k_pe, positions, w_uk, w_uv, scale)
        q_nope [T, H, N], q_pe [T, H, P] (rotated), c_kv [T, R] (normalized), k_pe [T, P]
        (rotated), positions [T], w_uk [H, N, R], w_uv [H, R, V] (views of kv_b_proj.weight)
        -> [T, H, V], the input of o_proj

``latent_cache.ContiguousLatentCache`` implements it for one sequence (expanded for a prompt,
absorbed for a decode); the engine's paged context (``attention.py``'s
``PagedAttention.attend_latent``) implements it with ``store_latent`` and the backend's
``paged_mla_attention`` over block tables.

Refused by the config (``config.py``), by name: mixture-of-experts layers (every layer must be
dense, ``first_k_dense_replace >= num_hidden_layers``), YaRN rope scaling (its softmax mscale is
not implemented), ``num_key_value_heads`` other than ``num_attention_heads``. Names are Hugging
Face's, so a checkpoint's state dict loads as it is.
"""

from dataclasses import dataclass

import torch
from torch import nn

from ..ops import REFERENCE_BACKEND, Backend
from ..ops.mla import rotary_interleaved
from .config import ModelConfig
from .llama import LlamaDecoderLayer, RMSNorm
from .rope import rope_inv_freq

# transformers builds q_a_layernorm and kv_a_layernorm with RMSNorm's default eps, not the
# config's rms_norm_eps (which only the layer norms use).
LATENT_NORM_EPS = 1e-6


# --8<-- [start:kv_bytes]
@dataclass(frozen=True)
class MLAKVBytes:
    """KV cache bytes per token, every layer: ``expanded`` as a multi-head cache of the
    decompressed K (N + P per head) and V (V per head) would hold them, ``latent`` as MLA holds
    them (R + P per layer, whatever the head count)."""

    expanded: int
    latent: int

    @property
    def ratio(self) -> float:
        return self.expanded / self.latent


def mla_kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype | None = None) -> MLAKVBytes:
    """What one token costs the KV cache of an MLA model, in dtype (default: the checkpoint's).

    DeepSeek-V2 (60 layers, 128 heads, R 512, P 64, N 128, V 128, bf16): 128 * (192 + 128) =
    40,960 numbers a layer expanded against 512 + 64 = 576 latent, 4.7 MiB against 67.5 KiB a
    token: 71 times fewer bytes, so 71 times the tokens in the same pool."""
    if not cfg.is_mla:
        raise ValueError(f"model_type {cfg.model_type!r} has no latent attention (kv_lora_rank "
                         "0): its cache is K and V per KV head (reference/kv_size.py)")
    size = torch.empty((), dtype=dtype or cfg.dtype).element_size()
    expanded = cfg.num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    return MLAKVBytes(expanded=cfg.num_layers * expanded * size,
                      latent=cfg.num_layers * latent * size)
# --8<-- [end:kv_bytes]


class LatentUpProjection(nn.Module):
    """kv_b_proj: a weight [H * (N + V), R] that is never applied as a product of its own.
    The attention splits it per head into W_UK and W_UV (``latent_projections``) and folds
    them into the query and the output (``ops/mla.py``), so it is not an nn.Linear: a tier
    that repacks or quantizes the linear layers must leave this weight as it is."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))


class DeepseekV2Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = H = cfg.num_heads
        self.q_lora_rank = cfg.q_lora_rank
        self.kv_lora_rank = R = cfg.kv_lora_rank
        self.qk_nope_head_dim = N = cfg.qk_nope_head_dim
        self.qk_rope_head_dim = P = cfg.qk_rope_head_dim
        self.v_head_dim = V = cfg.v_head_dim
        d, bias = cfg.hidden_size, cfg.attention_bias  # hf: a bias on the "a" projections, o
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(d, H * (N + P), bias=False)
        else:
            self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * (N + P), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, R + P, bias=bias)
        self.kv_a_layernorm = RMSNorm(R, LATENT_NORM_EPS)
        self.kv_b_proj = LatentUpProjection(R, H * (N + V))
        self.o_proj = nn.Linear(H * V, d, bias=bias)
        self.inv_freq = rope_inv_freq(P, cfg.rope_theta, cfg.rope_scaling)  # RoPE on P only
        self.scale = (N + P) ** -0.5  # the expanded head's dim, in both forms

    def latent_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's weight [H * (N + V), R] split per head: W_UK [H, N, R] (c_kv -> k_nope)
        and W_UV [H, R, V] (c_kv -> v); views, no copy (vLLM's W_UK_T and W_UV)."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim,
                                       self.kv_lora_rank)  # [H, N + V, R]
        return w[:, :self.qk_nope_head_dim], w[:, self.qk_nope_head_dim:].transpose(1, 2)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        # --8<-- [start:mla_forward]
        T, ops = x.shape[0], attn.backend
        H, N, P = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim
        if self.q_lora_rank is None:
            q = self.q_proj(x)  # [T, H * (N + P)]
        else:  # the query through its own low-rank bottleneck
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x), ops=ops)[0])
        q_nope, q_pe = q.view(T, H, N + P).split([N, P], dim=-1)  # [T, H, N], [T, H, P]
        # [T, R], [T, P]: the only per-token K/V state, what the cache keeps
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, P], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv, ops=ops)[0]  # [T, R]
        q_pe, k_pe = rotary_interleaved(q_pe, k_pe[:, None, :], positions, self.inv_freq)
        w_uk, w_uv = self.latent_projections()  # [H, N, R], [H, R, V]
        out = attn.attend_latent(self.layer_idx, q_nope, q_pe, c_kv, k_pe[:, 0], positions,
                                 w_uk, w_uv, self.scale)  # [T, H, V]
        # --8<-- [end:mla_forward]
        return self.o_proj(out.reshape(T, -1))  # [T, hidden]


class DeepseekV2DecoderLayer(LlamaDecoderLayer):
    """Llama's layer (pre-norm, the deferred residual add, hf's DeepseekV2MLP: the same SwiGLU
    and names) with latent attention in place of per-head K/V."""

    attention_class = DeepseekV2Attention


class DeepseekV2Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DeepseekV2DecoderLayer(cfg, i)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV2ForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if not cfg.is_mla:
            raise ValueError(f"DeepseekV2ForCausalLM needs an MLA config (kv_lora_rank >= 1), "
                             f"got model_type {cfg.model_type!r}")
        self.config = cfg
        self.model = DeepseekV2Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attn,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """token_ids [T], positions [T] -> logits [T, vocab] (or [S, vocab] for the rows
        logits_indices [S]); attn must have ``attend_latent`` (module docstring)."""
        if not hasattr(attn, "attend_latent"):
            raise TypeError(f"{type(attn).__name__} has no attend_latent: DeepSeek-V2 caches "
                            "one latent per token (MLA), not per-head K/V; run it with "
                            "latent_cache.ContiguousLatentCache")
        x, residual = self.model.embed_tokens(token_ids), None  # [T, hidden]
        for layer in self.model.layers:
            x, residual = layer(x, residual, positions, attn)
        return self.compute_logits(x, residual, attn.backend, logits_indices)

    def compute_logits(self, x: torch.Tensor, residual: torch.Tensor,
                       ops: Backend = REFERENCE_BACKEND,
                       logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """The last layer's output x [T, hidden] and the residual stream -> logits."""
        x = x + residual  # the last layer's output joins the stream
        if logits_indices is not None:
            x = x[logits_indices]  # [S, hidden]
        x, _ = self.model.norm(x, ops=ops)
        return self.lm_head(x)  # [S, vocab]
