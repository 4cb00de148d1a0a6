"""Solution to lesson 12's exercise: KV bytes per token and grouped decode attention."""

import torch


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                       dtype_bytes: int) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes  # K and V


def mla_bytes_per_token(num_layers: int, kv_lora_rank: int, rope_head_dim: int,
                        dtype_bytes: int) -> int:
    return num_layers * (kv_lora_rank + rope_head_dim) * dtype_bytes  # no factor 2: one latent


def grouped_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   scale: float) -> torch.Tensor:
    heads, d = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    q = q.view(kv_heads, group, d)  # the rows of K/V head j are query heads j*group .. +group-1
    scores = torch.einsum("jgd,sjd->jgs", q, k) * scale  # each K/V head's keys used once
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)  # [kv_heads, group, S]
    out = torch.einsum("jgs,sjd->jgd", probs, v)
    return out.reshape(heads, d)


def kv_bytes_read(seq_len: int, num_heads: int, num_kv_heads: int, head_dim: int,
                  dtype_bytes: int, grouped: bool) -> int:
    readers = num_kv_heads if grouped else num_heads
    return readers * 2 * seq_len * head_dim * dtype_bytes
