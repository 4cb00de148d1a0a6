"""The Llama family of decoders: Llama 2/3, Mistral, Qwen2, Qwen3.

Tokens laid flat: token_ids [T] and their positions [T], from one sequence or from many laid end
to end (the engine's step). Only attention must keep sequences apart, and it does so through the
attention context the forward is handed (``attention.py``); with no cache T is the whole
sequence, with a cache only the tokens not yet stored. The step's small ops (RMSNorm with its
residual add, rotary, SiLU-and-mul) come from the context's backend, so a faster tier swaps
them without touching this file. Module and parameter names are Hugging Face's, so a
checkpoint's state dict loads as it is.

The members differ in small switches read from the config: grouped-query attention (fewer K/V
heads than query heads), a bias on q/k/v (Qwen2), an RMSNorm on each head's q and k (Qwen3), a
sliding attention window (Mistral), Llama 3's RoPE scaling, tied input/output embeddings.
"""

import torch
from torch import nn

from ..ops import REFERENCE_BACKEND, Backend
from .config import ModelConfig
from .rope import rope_inv_freq


class RMSNorm(nn.Module):
    """Holds the weight; the arithmetic is the backend's rms_norm (with the residual add)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                ops: Backend = REFERENCE_BACKEND) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.rms_norm(x, self.weight, self.eps, residual)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = hd = cfg.head_dim
        d, qkv_bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(d, cfg.num_heads * hd, bias=qkv_bias)
        self.k_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=qkv_bias)
        self.v_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * hd, d, bias=cfg.o_proj_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.sliding_window = cfg.sliding_windows[layer_idx] if cfg.sliding_windows else None
        self.scale = cfg.head_dim**-0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        # --8<-- [start:store_and_fetch]
        T, ops = x.shape[0], attn.backend
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)  # [T, heads, head_dim]
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)  # [T, kv_heads, head_dim]
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)  # [T, kv_heads, head_dim]
        if self.qk_norm:  # Qwen3: an RMSNorm over each head's features
            q = self.q_norm(q, ops=ops)[0]
            k = self.k_norm(k, ops=ops)[0]
        q, k = ops.rotary(q, k, positions, self.inv_freq)  # K is stored already rotated
        out = attn.attend(self.layer_idx, q, k, v, positions, self.scale,
                          self.sliding_window)  # [T, heads, head_dim]
        # --8<-- [end:store_and_fetch]
        return self.o_proj(out.reshape(T, -1))  # [T, hidden]


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor, ops: Backend = REFERENCE_BACKEND) -> torch.Tensor:
        gate_up = torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)  # [T, 2 * inter]
        return self.down_proj(ops.silu_and_mul(gate_up))  # SwiGLU: [T, hidden]


class LlamaDecoderLayer(nn.Module):
    attention_class = LlamaAttention  # DeepSeek-V2's layer is this one with latent attention

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self.attention_class(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                attn) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (this layer's output, the residual stream before it is added).

        The residual add is deferred into the next norm (fused add + RMSNorm): the stream is
        residual + x, the same sums in the same order as ``x = x + sublayer(norm(x))``.
        """
        ops = attn.backend
        h, residual = self.input_layernorm(x, residual, ops)  # [T, hidden] each
        h = self.self_attn(h, positions, attn)
        h, residual = self.post_attention_layernorm(h, residual, ops)
        return self.mlp(h, ops), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attn,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """token_ids [T], positions [T] -> logits [T, vocab], or [S, vocab] for the rows
        logits_indices [S] (sampling needs only the rows that predict a next token)."""
        x, residual = self.model.embed_tokens(token_ids), None  # [T, hidden]
        for layer in self.model.layers:
            x, residual = layer(x, residual, positions, attn)
        return self.compute_logits(x, residual, attn.backend, logits_indices)

    def compute_logits(self, x: torch.Tensor, residual: torch.Tensor, ops: Backend,
                       logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """The last layer's output x [T, hidden] and the residual stream -> logits."""
        x = x + residual  # the last layer's output joins the stream
        if logits_indices is not None:
            x = x[logits_indices]  # [S, hidden]
        x, _ = self.model.norm(x, ops=ops)
        return self.lm_head(x)  # [S, vocab]
