"""Exercise (lesson 10, "The PagedAttention kernel"): the decode kernel's tile loop, in Triton.

A batch of B decodes has one query per sequence, q [B, heads, head_dim]. Sequence b has
seq_lens[b] tokens in the paged cache, k_cache and v_cache [num_blocks, block_size, kv_heads,
head_dim]: key position p lies in block block_tables[b, p // block_size], at slot
p % block_size. The query sits at the last position, so it sees every key 0 .. seq_len - 1.
heads may be a multiple of kv_heads (grouped-query attention): query head h reads K/V head
h // (heads // kv_heads).

Write the body of paged_decode_kernel below: one program per (sequence, query head) walks its
sequence's blocks through the block table, one block per tile, and keeps the online softmax's
running max, sum and accumulator (lesson 11), so that it never holds more than one block of
scores. The launcher, paged_decode, is written for you; once your kernel is written, delete the
line that raises NotImplementedError in it. Lesson 10's section "Exercise: the tile loop in
Triton" explains the kernel. Check your work with

    pytest lessons/exercises/test_triton_paged_attention_exercise.py

The test runs your kernel through Triton's interpreter on CPU tensors and compares it with
pagedllm.reference.ops.paged_attention: pools whose unwritten slots are NaN, blocks handed out
in shuffled order, lengths that end mid-block, block tables with padding entries, GQA and MQA,
and scores large enough that exp overflows without the running max. Until you edit this file
the test reports your version as skipped and checks only the solution.

한국어:
연습 문제(10강, "PagedAttention 커널"): Triton으로 작성하는 디코드 커널의 타일 루프.

디코드 B개의 배치는 시퀀스마다 쿼리가 하나씩이며, q는 [B, heads, head_dim]입니다. 시퀀스 b는
페이징된 캐시 k_cache와 v_cache [num_blocks, block_size, kv_heads, head_dim]에 토큰
seq_lens[b]개를 가집니다: 키 위치 p는 블록 block_tables[b, p // block_size]의 슬롯
p % block_size에 있습니다. 쿼리는 마지막 위치에 있으므로 키 0 .. seq_len - 1을 모두 봅니다.
heads는 kv_heads의 배수일 수 있습니다(그룹 쿼리 어텐션): 쿼리 헤드 h는 K/V 헤드
h // (heads // kv_heads)를 읽습니다.

아래 paged_decode_kernel의 본문을 작성하세요: (시퀀스, 쿼리 헤드)마다 프로그램 하나가 블록
테이블을 거쳐 자기 시퀀스의 블록을 타일당 블록 하나씩 훑으며, 온라인 소프트맥스의 누적 최댓값, 합,
누산기를 유지해(11강) 점수를 블록 하나 분량보다 많이 가지지 않습니다. 런처인 paged_decode는 이미
작성되어 있습니다. 커널을 다 작성하면 런처 안에서 NotImplementedError를 발생시키는 줄을 지우세요.
10강의 "연습 문제: Triton으로 타일 루프 작성하기" 절이 커널을 설명합니다. 다음 명령으로
확인하세요:

    pytest lessons/exercises/test_triton_paged_attention_exercise.py

테스트는 여러분의 커널을 CPU 텐서 위에서 Triton 인터프리터로 돌리고
pagedllm.reference.ops.paged_attention과 비교합니다: 쓰지 않은 슬롯이 NaN인 풀, 뒤섞인 순서로 나눠
준 블록, 블록 중간에서 끝나는 길이, 패딩 항목이 있는 블록 테이블, GQA와 MQA, 그리고 누적 최댓값
없이는 exp가 오버플로할 만큼 큰 점수를 씁니다. 이 파일을 고치기 전까지 테스트는 여러분의 버전을
skipped로 보고하고 해답만 확인합니다.
"""

import torch
import triton
import triton.language as tl

from pagedllm.kernels.runtime import kernel_runner


@triton.jit
def paged_decode_kernel(
    out_ptr,                   # [B, heads, head_dim], contiguous: written
    q_ptr,                     # [B, heads, head_dim], contiguous: one query per sequence
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, kv_heads, head_dim], contiguous
    block_tables_ptr,          # [B, max_blocks] int32, contiguous
    seq_lens_ptr,              # [B]: tokens in the cache per sequence, at least 1
    scale,                     # softmax scale, head_dim ** -0.5 for most models
    max_blocks, num_heads, num_kv_heads,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,    # HEAD_DIM rounded up to a power of two
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block, a power of two
):
    """Program (b, h) (tl.program_id(0), tl.program_id(1)) writes out[b, h] =
    softmax(q[b, h] . k * scale) . v over the keys and values of positions 0 .. seq_lens[b] - 1
    of sequence b, K/V head h // (num_heads // num_kv_heads). Element (block, slot, kv_head, d)
    of a pool lies at offset ((block * BLOCK_SIZE + slot) * num_kv_heads + kv_head) * HEAD_DIM
    + d. Slots at or past seq_len, and block table entries past the sequence's last block, may
    hold anything (NaN in the test): they must not be loaded.
    """
    # Your code here: the whole body.


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """Decode attention, one query per sequence: q [B, heads, head_dim] over the paged cache
    k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim] through block_tables
    [B, max_blocks] and seq_lens [B] -> [B, heads, head_dim]. The same numbers as
    pagedllm.reference.ops.paged_attention with query_start_loc = [0, 1, ..., B]."""
    raise NotImplementedError("exercise: write paged_decode_kernel's body, then delete this line")
    runner = kernel_runner(paged_decode_kernel, q, k_cache, v_cache, block_tables, seq_lens)
    if runner is None:
        raise RuntimeError("this exercise runs its kernel: pass CUDA tensors, or set "
                           "TRITON_INTERPRET=1 to run it on the CPU through Triton's interpreter")
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not split into {num_kv_heads} groups")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size {block_size}: the kernel's tile is one block, a power of 2")
    if block_tables.shape[0] != num_seqs or seq_lens.shape != (num_seqs,):
        raise ValueError(f"{num_seqs} queries, {block_tables.shape[0]} block tables and "
                         f"{seq_lens.shape[0]} lengths: one each per sequence")
    q, k_cache, v_cache = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
    block_tables, seq_lens = block_tables.contiguous(), seq_lens.contiguous()
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    runner[(num_seqs, num_heads)](
        out, q, k_cache, v_cache, block_tables, seq_lens, scale,
        block_tables.shape[1], num_heads, num_kv_heads,
        HEAD_DIM=head_dim, HEAD_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
    )
    return out
