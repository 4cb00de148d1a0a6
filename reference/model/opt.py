"""OPT, the model family of the PagedAttention paper (OPT-13B in its experiments).

Older than Llama and different in three ways the cache does not care about: positions are
learned embeddings (looked up at position + 2, an offset OPT inherited from fairseq), the MLP is
fc1 -> ReLU -> fc2, and LayerNorm (with biases) comes before each block (pre-LN; OPT-350m alone
puts it after). Every head has its own K and V (num_kv_heads == num_heads), so OPT's KV cache is
as large as a model of its width can make it. Names are Hugging Face's, so checkpoints load as
they are.
"""

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig

POSITION_OFFSET = 2  # OPT's learned position table starts at index 2


class OPTAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        d, bias = cfg.hidden_size, cfg.enable_bias
        self.q_proj = nn.Linear(d, d, bias=bias)
        self.k_proj = nn.Linear(d, d, bias=bias)
        self.v_proj = nn.Linear(d, d, bias=bias)
        self.out_proj = nn.Linear(d, d, bias=bias)
        self.scale = cfg.head_dim**-0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)  # [T, heads, head_dim]
        k = self.k_proj(x).view(T, self.num_heads, self.head_dim)
        v = self.v_proj(x).view(T, self.num_heads, self.head_dim)
        out = attn.attend(self.layer_idx, q, k, v, positions, self.scale)
        return self.out_proj(out.reshape(T, -1))  # [T, hidden]


class OPTDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        affine = cfg.layer_norm_elementwise_affine
        self.self_attn = OPTAttention(cfg, layer_idx)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.hidden_size, elementwise_affine=affine)
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.enable_bias)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.enable_bias)
        self.final_layer_norm = nn.LayerNorm(cfg.hidden_size, elementwise_affine=affine)
        self.pre_ln = cfg.do_layer_norm_before

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        h = self.self_attn_layer_norm(x) if self.pre_ln else x
        x = x + self.self_attn(h, positions, attn)
        if not self.pre_ln:
            x = self.self_attn_layer_norm(x)
        h = self.final_layer_norm(x) if self.pre_ln else x
        x = x + self.fc2(F.relu(self.fc1(h)))
        return x if self.pre_ln else self.final_layer_norm(x)


class OPTDecoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        proj_dim = cfg.word_embed_proj_dim
        self.embed_tokens = nn.Embedding(cfg.vocab_size, proj_dim)
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings + POSITION_OFFSET,
                                            cfg.hidden_size)
        if proj_dim != cfg.hidden_size:  # OPT-350m embeds in 512 dims and projects to 1024
            self.project_in = nn.Linear(proj_dim, cfg.hidden_size, bias=False)
            self.project_out = nn.Linear(cfg.hidden_size, proj_dim, bias=False)
        if cfg.final_layer_norm:
            self.final_layer_norm = nn.LayerNorm(
                cfg.hidden_size, elementwise_affine=cfg.layer_norm_elementwise_affine)
        self.layers = nn.ModuleList(OPTDecoderLayer(cfg, i) for i in range(cfg.num_layers))


class OPTModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.decoder = OPTDecoder(cfg)


class OPTForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = OPTModel(cfg)
        self.lm_head = nn.Linear(cfg.word_embed_proj_dim, cfg.vocab_size, bias=False)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attn,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """token_ids [T], positions [T] -> logits [T, vocab], or [S, vocab] for the rows
        logits_indices [S]."""
        dec = self.model.decoder
        x = dec.embed_tokens(token_ids)  # [T, proj_dim]
        if hasattr(dec, "project_in"):
            x = dec.project_in(x)  # [T, hidden]
        x = x + dec.embed_positions(positions + POSITION_OFFSET)
        for layer in dec.layers:
            x = layer(x, positions, attn)
        if logits_indices is not None:
            x = x[logits_indices]
        if hasattr(dec, "final_layer_norm"):
            x = dec.final_layer_norm(x)
        if hasattr(dec, "project_out"):
            x = dec.project_out(x)  # [T, proj_dim]
        return self.lm_head(x)  # [T, vocab]
