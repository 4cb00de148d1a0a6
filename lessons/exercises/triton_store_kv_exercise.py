"""Exercise (lesson 13, "Fusing the small ops"): store_kv as a Triton kernel.

One engine step computes a K row and a V row for each of its T tokens, k and v of shape
[T, kv_heads, head_dim]. The block table has already given every token a *slot*: its row in
the flat view of the paged pool, [num_blocks * block_size, kv_heads, head_dim]. Slot -1 marks
a padding row, whose K and V must not be stored anywhere. The torch twin,
pagedllm.reference.ops.store_kv, drops the -1 rows and then makes two indexed assignments.

Write the body of store_kv_kernel below: one program per token copies that token's K rows and
V rows (every KV head) to its slot, and a token with slot -1 changes nothing. The launcher,
store_kv, is written for you; once your kernel is written, delete the line that raises
NotImplementedError in it. Lesson 13's section "Exercise: store_kv in Triton" explains the
kernel; lesson 10's "Running it on a CPU" how it runs without a GPU. Check your work with

    pytest lessons/exercises/test_triton_store_kv_exercise.py

The test runs your kernel through Triton's interpreter on CPU tensors and compares the pools
it leaves, bit for bit, with the twin's, on pools whose every slot starts as NaN, with padding
rows, non-power-of-two head counts and sizes, and k, v sliced out of a fused QKV tensor (rows
that are not contiguous). Until you edit this file the test reports your version as skipped
and checks only the solution.

한국어:
연습 문제(13강, "작은 연산 융합하기"): Triton 커널로 작성하는 store_kv.

엔진 스텝 하나는 토큰 T개마다 K 행과 V 행을 하나씩 계산하며, k와 v의 형태는 [T, kv_heads,
head_dim]입니다. 블록 테이블은 이미 토큰마다 *슬롯*을 정해 두었습니다: 페이지 단위 풀의 평평한 뷰
[num_blocks * block_size, kv_heads, head_dim]에서 그 토큰의 행입니다. 슬롯 -1은 패딩 행을
나타내며, 그 K와 V는 어디에도 저장하면 안 됩니다. torch 트윈인 pagedllm.reference.ops.store_kv는
-1인 행을 버린 뒤 인덱스 대입을 두 번 합니다.

아래 store_kv_kernel의 본문을 작성하세요: 토큰마다 프로그램 하나가 그 토큰의 K 행과 V 행(모든 KV
헤드)을 자기 슬롯에 복사하고, 슬롯이 -1인 토큰은 아무것도 바꾸지 않습니다. 런처인 store_kv는 이미
작성되어 있습니다. 커널을 다 작성하면 런처 안에서 NotImplementedError를 발생시키는 줄을 지우세요.
13강의 "연습 문제: Triton으로 store_kv 작성하기" 절이 커널을, 10강의 "CPU에서 실행하기" 절이 GPU
없이 실행하는 방법을 설명합니다. 다음 명령으로 확인하세요:

    pytest lessons/exercises/test_triton_store_kv_exercise.py

테스트는 여러분의 커널을 CPU 텐서 위에서 Triton 인터프리터로 돌리고, 커널이 남긴 풀을 트윈의 것과
비트 단위로 비교합니다. 모든 슬롯이 NaN으로 시작하는 풀, 패딩 행, 2의 거듭제곱이 아닌 헤드 수와
크기, 융합된 QKV 텐서에서 잘라 낸 k, v(연속적이지 않은 행)를 씁니다. 이 파일을 고치기 전까지
테스트는 여러분의 버전을 skipped로 보고하고 해답만 확인합니다.
"""

import torch
import triton
import triton.language as tl

from pagedllm.kernels.runtime import kernel_runner


@triton.jit
def store_kv_kernel(
    k_ptr, v_ptr,              # [T, kv_heads, head_dim] each, last dimension contiguous
    k_cache_ptr, v_cache_ptr,  # [num_blocks * block_size, kv_heads, head_dim], contiguous
    slot_ptr,                  # [T] int32 or int64: each token's slot, -1 = not stored
    stride_kt, stride_kh,      # k's strides (elements) over tokens and heads
    stride_vt, stride_vh,      # v's
    kv_heads, head_dim,
    BLOCK_H: tl.constexpr,     # kv_heads rounded up to a power of two
    BLOCK_D: tl.constexpr,     # head_dim rounded up to a power of two
):
    """Program t (tl.program_id(0)) stores token t: k[t, h, d], at k_ptr + t * stride_kt +
    h * stride_kh + d, goes to row (slot, h) of the K pool, and v[t] to the V pool the same
    way. With slot -1 nothing is written. Element (slot, h, d) of a pool lies at offset
    (slot * kv_heads + h) * head_dim + d; lanes past kv_heads or head_dim must not be touched.
    """
    # Your code here: the whole body.


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k, v [T, kv_heads, head_dim] into k_cache, v_cache [num_blocks, block_size,
    kv_heads, head_dim] at the slots slot_mapping [T] (-1: skip), like
    pagedllm.reference.ops.store_kv."""
    raise NotImplementedError("exercise: write store_kv_kernel's body, then delete this line")
    runner = kernel_runner(store_kv_kernel, k, v, k_cache, v_cache, slot_mapping)
    if runner is None:
        raise RuntimeError("this exercise runs its kernel: pass CUDA tensors, or set "
                           "TRITON_INTERPRET=1 to run it on the CPU through Triton's interpreter")
    num_tokens, kv_heads, head_dim = k.shape
    if k_cache.shape[2:] != (kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"k, v {tuple(k.shape)}, {tuple(v.shape)} do not fit a cache of rows "
                         f"{tuple(k_cache.shape[2:])}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the kernel addresses the pool as contiguous: pass contiguous caches")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("the kernel reads k and v rows with stride 1: their last dimension "
                         "must be contiguous")
    if num_tokens == 0:
        return
    runner[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_heads, head_dim,
        BLOCK_H=triton.next_power_of_2(kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )
