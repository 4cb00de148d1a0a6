"""The Llama family of decoders: Llama 2/3, Mistral, Qwen2, Qwen3.

One sequence at a time, tokens laid flat: token_ids [T] and their positions [T]. With no cache T
is the whole sequence; with a cache it is only the tokens not yet stored (the whole prompt at
prefill, one token per decode step). Module and parameter names are Hugging Face's, so a
checkpoint's state dict loads as it is.

The members differ in small switches read from the config: grouped-query attention (fewer K/V
heads than query heads), a bias on q/k/v (Qwen2), an RMSNorm on each head's q and k (Qwen3), a
sliding attention window (Mistral), Llama 3's RoPE scaling, tied input/output embeddings.
"""

import torch
import torch.nn.functional as F
from torch import nn

from .attention import attend
from .config import ModelConfig
from .rope import apply_rope, rope_inv_freq


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # the mean of squares is taken in float32, as Hugging Face does
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


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

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)  # [T, heads, head_dim]
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)  # [T, kv_heads, head_dim]
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)  # [T, kv_heads, head_dim]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, positions, self.inv_freq)
        k = apply_rope(k, positions, self.inv_freq)  # K is stored already rotated
        # --8<-- [start:store_and_fetch]
        out = attend(cache, self.layer_idx, q, k, v, positions, self.scale,
                     self.sliding_window)  # [T, heads, head_dim]
        # --8<-- [end:store_and_fetch]
        return self.o_proj(out.reshape(T, -1))  # [T, hidden]


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


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

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, cache,
                logits_rows=None) -> torch.Tensor:
        """token_ids [T], positions [T] -> logits [T, vocab], or [R, vocab] for logits_rows."""
        x = self.model.embed_tokens(token_ids)  # [T, hidden]
        for layer in self.model.layers:
            x = layer(x, positions, cache)
        if logits_rows is not None:  # sampling needs only each sequence's last row
            x = x[logits_rows]
        return self.lm_head(self.model.norm(x))  # [T, vocab]
