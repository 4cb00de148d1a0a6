"""Gemma 3's text decoder (transformers' Gemma3ForCausalLM, model_type "gemma3_text").

Its layers alternate two kinds of attention, named per layer by ``layer_types``: most slide over
the last W keys (local: W = ``sliding_window``, e.g. 1024), one in every few reads the whole
sequence (global). A sliding layer reads at most W keys however long the sequence runs, which
is why only the global layers' KV cache must grow with it. Each kind turns its rotary at its own
base: the local layers at 10,000, the global ones at 1,000,000 (linearly scaled in the larger
models), so ``layer_ropes`` gives every layer its own frequencies.

Beside the Llama family it differs in small ways, each kept as Hugging Face computes it:

- the embeddings are multiplied by sqrt(hidden_size), rounded to the model's dtype first;
- RMSNorm scales by (1 + weight) (a checkpoint's zero weight is the identity), in float32,
  rounding to the dtype only after the product; and there are four norms a layer, a sublayer's
  output normed too before it joins the residual stream, so no add fuses into the next norm;
- q and k are normed per head (as Qwen3's) and the scores scaled by query_pre_attn_scalar^-1/2;
- the MLP is GeGLU: down(gelu_tanh(gate(x)) * up(x));
- optional final_logit_softcapping: logits squashed into (-cap, cap) by cap * tanh(logits / cap).

Tokens are laid flat as in ``llama.py`` (token_ids [T], positions [T]), and layers reach their
keys and values through the attention context. The norms and the GELU are computed here in
torch, not by the backend's ops: the backend's rms_norm rounds before it scales (Llama's order)
and it has no GELU. Names are Hugging Face's, so a checkpoint's state dict loads as it is.
"""

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .rope import rope_inv_freq


class Gemma3RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))  # stored as the offset from 1
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] -> normed [..., dim], in x's dtype."""
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)  # scaled, then rounded


def embed_scale(hidden_size: int, dtype: torch.dtype) -> float:
    """sqrt(hidden_size) rounded to dtype, as Hugging Face rounds it (bf16: sqrt(3072) is
    55.5, not 55.43): a Python number, so a CUDA graph records it without a copy."""
    return torch.tensor(hidden_size**0.5).to(dtype).item()


class Gemma3Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = hd = cfg.head_dim
        d, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(d, cfg.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * hd, d, bias=cfg.o_proj_bias)
        self.q_norm = Gemma3RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = Gemma3RMSNorm(hd, cfg.rms_norm_eps)
        theta, scaling = (cfg.layer_ropes[layer_idx] if cfg.layer_ropes
                          else (cfg.rope_theta, cfg.rope_scaling))
        self.inv_freq = rope_inv_freq(hd, theta, scaling)  # this layer kind's base
        self.sliding_window = cfg.sliding_windows[layer_idx] if cfg.sliding_windows else None
        self.scale = (cfg.query_pre_attn_scalar or hd) ** -0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        T, ops = x.shape[0], attn.backend
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)  # [T, heads, head_dim]
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)  # [T, kv_heads, head_dim]
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)  # [T, kv_heads, head_dim]
        q, k = self.q_norm(q), self.k_norm(k)  # over each head's features
        q, k = ops.rotary(q, k, positions, self.inv_freq)  # K is stored already rotated
        out = attn.attend(self.layer_idx, q, k, v, positions, self.scale,
                          self.sliding_window)  # [T, heads, head_dim]
        return self.o_proj(out.reshape(T, -1))  # [T, hidden]


class Gemma3MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = F.gelu(self.gate_proj(x), approximate="tanh")  # [T, inter]
        return self.down_proj(gate * self.up_proj(x))  # GeGLU: [T, hidden]


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = Gemma3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Gemma3Attention(cfg, layer_idx)
        self.post_attention_layernorm = Gemma3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = Gemma3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Gemma3MLP(cfg)
        self.post_feedforward_layernorm = Gemma3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]: each sublayer's output is normed before it joins the
        residual stream (a "sandwich"), so the stream is added here, not in the next norm."""
        h = self.self_attn(self.input_layernorm(x), positions, attn)  # [T, hidden]
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))  # [T, hidden]
        return x + self.post_feedforward_layernorm(h)


class Gemma3TextModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = Gemma3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Gemma3ForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Gemma3TextModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attn,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """token_ids [T], positions [T] -> logits [T, vocab], or [S, vocab] for the rows
        logits_indices [S] (sampling needs only the rows that predict a next token)."""
        # The scale multiplies the looked-up rows, not the table: the table is also the tied
        # LM head's, and a tensor-parallel rank's embedding holds only its slice of it.
        x = self.model.embed_tokens(token_ids)  # [T, hidden]
        x = x * embed_scale(self.config.hidden_size, x.dtype)
        for layer in self.model.layers:
            x = layer(x, positions, attn)
        return self.compute_logits(x, logits_indices)

    def compute_logits(self, x: torch.Tensor,
                       logits_indices: torch.Tensor | None = None) -> torch.Tensor | None:
        """The last layer's output x [T, hidden] -> logits [S, vocab] (None on a
        tensor-parallel rank other than 0, whose LM head gathers to rank 0)."""
        if logits_indices is not None:
            x = x[logits_indices]  # [S, hidden]
        logits = self.lm_head(self.model.norm(x))  # [S, vocab]
        cap = self.config.final_logit_softcapping
        if cap is None or logits is None:
            return logits
        return torch.tanh(logits / cap) * cap  # squashed into (-cap, cap)
