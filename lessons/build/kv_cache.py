"""Milestone 1 of the build-it track: the paged KV pool (lessons/build/01-kv-cache.md).

Write the four functions below. Check your work with

    pytest lessons/build/test_build_kv_cache.py

The pool is one K tensor and one V tensor per layer, each [num_blocks, block_size, kv_heads,
head_dim]. A slot is one token's row in the flat view [num_blocks * block_size, kv_heads,
head_dim]: slot = block * block_size + offset. Your engine's model layers call store_kv and
paged_attention through the attention context (pagedllm.reference.model.PagedAttention), with
exactly these arguments.

한국어:
엔진 직접 만들기 트랙의 마일스톤 1: 페이지 단위 KV 풀(lessons/build/01-kv-cache.md).

아래 네 함수를 작성하세요. 다음 명령으로 확인하세요:

    pytest lessons/build/test_build_kv_cache.py

풀은 레이어마다 K 텐서 하나와 V 텐서 하나이며, 각각 [num_blocks, block_size, kv_heads,
head_dim]입니다. 슬롯은 평평한 뷰 [num_blocks * block_size, kv_heads, head_dim]에서 토큰 하나의
행입니다: slot = block * block_size + offset. 여러분 엔진의 모델 레이어는 어텐션
컨텍스트(pagedllm.reference.model.PagedAttention)를 거쳐 바로 이 인자들로 store_kv와
paged_attention을 호출합니다.
"""

import torch


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                      head_dim: int, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu"
                      ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(k_caches, v_caches): num_layers tensors each, of [num_blocks, block_size, kv_heads,
    head_dim] in dtype on device. Every tensor is its own memory: no two share storage."""
    raise NotImplementedError("milestone 1: write allocate_kv_cache")


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write row t of k and v [T, kv_heads, head_dim] into slot slot_mapping[t] of k_cache
    and v_cache (one layer's), in place.

    slot_mapping [T] int64. A slot of -1 marks a row whose K/V must not be kept (padding): it
    writes nothing, anywhere. No other slot of the pool changes.
    """
    raise NotImplementedError("milestone 1: write store_kv")


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float,
                    sliding_window: int | None = None) -> torch.Tensor:
    """Attention of a flat batch of query rows over one layer's pool, this step's K/V already
    stored. Returns [T, heads, head_dim].

    q [T, heads, head_dim]: the rows of sequence b are query_start_loc[b]:query_start_loc[b+1]
    (int32 [B + 1]), and they are its last tokens: with seq_lens[b] (int32 [B]) tokens in the
    cache and q_len rows, row i sits at position seq_lens[b] - q_len + i. Each row attends
    causally to the sequence's keys at positions 0 .. its own. Sequence b's position p lives
    in block block_tables[b][p // block_size] (int32 [B, max_blocks]; entries past the
    sequence's last block are padding) at offset p % block_size.

    A slot the sequence has not filled (past seq_lens[b], or behind a padding entry) may hold
    anything, NaN included: it must not change the output. heads may be a multiple of
    kv_heads (grouped-query attention). You may use pagedllm.reference.ops.causal_attention
    for the softmax itself; sliding_window is None for the track's model (pass it on).
    """
    raise NotImplementedError("milestone 1: write paged_attention")


def copy_blocks(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                pairs: list[tuple[int, int]]) -> None:
    """For each (src, dst) of pairs: block dst becomes a copy of block src, in every layer, K
    and V (copy-on-write, milestone 2). Block src and every other block stay as they are."""
    raise NotImplementedError("milestone 1: write copy_blocks")
