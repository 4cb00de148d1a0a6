"""Exercise (lesson 17, "Quantizing the KV cache"): int8 and int4 rows, with their scales.

A token's K (or V) for one KV head is a row of head_dim numbers. The int8 and int4 caches store
each row as small integers plus bfloat16 numbers that say what the integers mean, computed when
the row is written (store_kv). Everything below is computed in float32 (x.float()).

int8, symmetric, one scale s per row:

    s     = largest |x| of the row / 127, rounded to bfloat16 (a row of zeros: s = 1)
    q     = floor(x / s + 0.5), clipped to [-127, 127]              s as stored, back in float32
    x_hat = q * s

    data: int8 [..., head_dim]; scales: bfloat16 [...]

int4, asymmetric, a scale s and a zero z per row, so that the 16 levels cover [min, max]:

    s     = (max - min) / 15, rounded to bfloat16 (max == min: s = 1)
    z     = min, rounded to bfloat16
    q     = floor((x - z) / s + 0.5), clipped to [0, 15]            s and z as stored
    x_hat = q * s + z

    data: uint8 [..., head_dim / 2], two values per byte: byte j holds q[j] in its low 4 bits and
    q[j + head_dim / 2] in its high 4 bits (the first half of the row in the low nibbles, the
    second half in the high ones); scales: bfloat16 [..., 2], (s, z)

Write both functions. Check your work with

    pytest lessons/exercises/test_kv_quant_exercise.py

The test checks the round-trip bound (half a step: |x - x_hat| <= s / 2 for int8), the rounding
and the int4 layout on rows with known answers, your bytes against the reference's
(reference/ops/kv_quant.py), and paged attention over a pool written with your quantizer and
read back with your dequantizer against the reference's. Until you edit this file the test
reports your version as skipped and checks only the solution.

한국어:
연습 문제(17강, "KV 캐시 양자화"): 스케일을 곁들인 int8 행과 int4 행.

KV 헤드 하나에 대한 토큰의 K(또는 V)는 head_dim개의 수로 된 행입니다. int8 캐시와 int4 캐시는 각
행을 작은 정수들과, 그 정수가 무엇을 뜻하는지 알려 주는 bfloat16 수들로 저장하며, 이 수들은 행을
쓸 때(store_kv) 계산합니다. 아래의 모든 계산은 float32(x.float())로 합니다.

int8, 대칭, 행마다 스케일 s 하나:

    s     = 행에서 가장 큰 |x| / 127, bfloat16으로 반올림 (0만 있는 행: s = 1)
    q     = floor(x / s + 0.5), [-127, 127]로 클리핑       s는 저장된 값을 float32로 되돌려 씀
    x_hat = q * s

    data: int8 [..., head_dim]; scales: bfloat16 [...]

int4, 비대칭, 행마다 스케일 s와 영점 z 하나씩, 16단계가 [min, max]를 덮도록:

    s     = (max - min) / 15, bfloat16으로 반올림 (max == min: s = 1)
    z     = min, bfloat16으로 반올림
    q     = floor((x - z) / s + 0.5), [0, 15]로 클리핑              s와 z는 저장된 값
    x_hat = q * s + z

    data: uint8 [..., head_dim / 2], 바이트당 값 두 개: 바이트 j는 하위 4비트에 q[j]를,
    상위 4비트에 q[j + head_dim / 2]를 담습니다(행의 앞쪽 절반은 하위 니블에, 뒤쪽 절반은
    상위 니블에); scales: bfloat16 [..., 2], (s, z)

두 함수를 모두 작성하세요. 다음 명령으로 확인하세요:

    pytest lessons/exercises/test_kv_quant_exercise.py

테스트는 왕복 오차의 한계(반 간격: int8에서 |x - x_hat| <= s / 2), 답을 아는 행에서의 반올림과
int4 배치, 여러분의 바이트가 레퍼런스(reference/ops/kv_quant.py)의 바이트와 같은지를 확인하고,
여러분의 양자화 함수로 쓰고 역양자화 함수로 다시 읽은 풀 위의 페이지 단위 어텐션을 레퍼런스의 것과
비교합니다. 이 파일을 고치기 전까지 테스트는 여러분의 버전을 skipped로 보고하고 해답만 확인합니다.
"""

import torch


def quantize_rows(x: torch.Tensor, kv_cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] (any float dtype) -> (data, scales), as the docstring above says.

    kv_cache_dtype "int8": data int8 [..., head_dim], scales bfloat16 [...];
    "int4": data uint8 [..., head_dim / 2], scales bfloat16 [..., 2] (scale, zero).
    """
    # 1. The row's statistics in float32: its largest |x| (int8), or its min and max (int4).
    # 2. The scale (and int4's zero), converted to bfloat16: that is what the cache stores. A
    #    scale of 0 (a row of zeros, or of equal values) would divide by 0: use 1 there.
    # 3. Quantize with the *stored* scale and zero (back in float32): round half up with
    #    torch.floor(y + 0.5) (torch.round rounds half to even: 2.5 -> 2), then clip.
    # 4. int8: convert. int4: convert to uint8 and pack the first half of the row into the low
    #    4 bits and the second half into the high 4 bits; stack (scale, zero) on a last axis.
    raise NotImplementedError("exercise: implement quantize_rows")


def dequantize_rows(data: torch.Tensor, scales: torch.Tensor, kv_cache_dtype: str,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(data, scales) as quantize_rows returns them -> x_hat [..., head_dim] in dtype."""
    # int4: unpack the low and high nibbles (& 0xF and >> 4) and put the halves back in order.
    # Then q * s (+ z for int4) in float32, and convert to dtype at the end.
    raise NotImplementedError("exercise: implement dequantize_rows")
