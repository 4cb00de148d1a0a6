"""Exercise (lesson 12, "MHA, GQA, MQA and MLA"): what a token costs, and attention by groups.

Write the four functions below. Check your work with

    pytest lessons/exercises/test_gqa_exercise.py

The test compares the byte counts with the KV size calculator's presets
(reference/kv_size.py) and DeepSeek-V2's published dimensions, and grouped_decode with the
reference attention (reference/ops/attention.py) for MHA, GQA and MQA shapes. Until you edit
this file the test reports your version as skipped and checks only the solution.

한국어:
연습 문제(12강, "MHA, GQA, MQA와 MLA"): 토큰 하나의 비용과 그룹 단위 어텐션.

아래 네 함수를 작성하세요. 다음 명령으로 확인하세요:

    pytest lessons/exercises/test_gqa_exercise.py

테스트는 바이트 수를 KV 크기 계산기의 프리셋(reference/kv_size.py) 및 DeepSeek-V2의 공개된 차원과
비교하고, grouped_decode를 MHA, GQA, MQA 형태에서 레퍼런스 어텐션(reference/ops/attention.py)과
비교합니다. 이 파일을 고치기 전까지 테스트는 여러분의 버전을 skipped로 보고하고 해답만 확인합니다.
"""

import torch


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                       dtype_bytes: int) -> int:
    """Bytes one token occupies in the KV cache of an MHA / GQA / MQA model (all layers)."""
    raise NotImplementedError("exercise: implement kv_bytes_per_token")


def mla_bytes_per_token(num_layers: int, kv_lora_rank: int, rope_head_dim: int,
                        dtype_bytes: int) -> int:
    """The same for multi-head latent attention: each layer caches one latent vector of
    kv_lora_rank numbers and one rotary key of rope_head_dim numbers, shared by every head."""
    raise NotImplementedError("exercise: implement mla_bytes_per_token")


def grouped_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """One decode query per head against S cached keys: q [heads, d], k and v [S, kv_heads, d]
    -> [heads, d]. Query head h reads K/V head h // (heads // kv_heads).

    Do it the way the kernel does: stack each K/V head's group of query heads as the rows of one
    matrix and multiply it with that head's keys once. Do not copy K or V once per query head
    (no repeat_interleave, no repeat: the test forbids them).
    """
    raise NotImplementedError("exercise: implement grouped_decode")


def kv_bytes_read(seq_len: int, num_heads: int, num_kv_heads: int, head_dim: int,
                  dtype_bytes: int, grouped: bool) -> int:
    """Bytes of K and V one decode step of one sequence reads from memory, in one layer.

    grouped=True: one program per K/V head reads that head's keys and values once for its whole
    group of query heads. grouped=False: one program per query head, each reading the K/V of
    its group's head for itself.
    """
    raise NotImplementedError("exercise: implement kv_bytes_read")
