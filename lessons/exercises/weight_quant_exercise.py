"""Exercise (lesson 18, "Quantizing the weights"): int4 weights in groups, with a scale and a
zero point per group, two codes a byte.

A linear layer's weight W is [out, in]: row n holds the weights output n multiplies its inputs
by. int4 cuts every row into groups of group_size consecutive inputs. Each group keeps its own
scale s and zero point z, and each weight becomes a 4-bit code q in 0..15 with

    W ~ (q - 8) * s + z

(torch's weight-only int4 kernels read this layout; z is the value code 8 stands for). Compute
in float32 (weight.float()); s and z are *stored* in the weight's dtype:

    lo, hi = the group's min and max
    s      = (hi - lo) / 15 rounded to weight.dtype, then at least that dtype's smallest
             normal, torch.finfo(weight.dtype).tiny (a group of equal values)
    z      = lo + 8 * s, with s as stored, rounded to weight.dtype
    q      = torch.round((w - z) / s) + 8, with s and z as stored, clipped to [0, 15]

    packed: uint8 [out, in / 2], two codes a byte: byte i of a row holds the code of input 2i
    in its low 4 bits and the code of input 2i + 1 in its high 4 bits
    scales, zeros: [out, in / group_size], in weight.dtype

A group size that does not divide the input size is refused with a ValueError that names both.

Write both functions. Check your work with

    pytest lessons/exercises/test_weight_quant_exercise.py

The test compares your codes, scales and zeros with the reference's (quantize_int4 and
dequantize_weight in reference/ops/weight_quant.py) bit for bit, checks the packing on a weight
with known codes, the round trip (off by at most half a step, s / 2), a group of equal values,
an outlier that must stay in its own group, the refusal, and runs your bytes through torch's
int4 kernel. Until you edit this file the test reports your version as skipped and checks only
the solution.

한국어:
연습 문제(18강, "가중치 양자화"): 그룹 단위 int4 가중치, 그룹마다 스케일과 영점 하나씩, 바이트당
코드 두 개.

선형 레이어의 가중치 W는 [out, in]입니다: 행 n에는 출력 n이 입력에 곱하는 가중치가 들어 있습니다.
int4는 모든 행을 연속된 입력 group_size개씩의 그룹으로 자릅니다. 그룹마다 자기 스케일 s와 영점 z를
가지며, 가중치 하나하나는 0..15 범위의 4비트 코드 q가 되어 다음을 만족합니다.

    W ~ (q - 8) * s + z

(torch의 가중치 전용 int4 커널이 이 배치를 읽습니다. z는 코드 8이 나타내는 값입니다.) 계산은
float32(weight.float())로 하고, s와 z는 가중치의 dtype으로 *저장*합니다:

    lo, hi = 그룹의 최솟값과 최댓값
    s      = (hi - lo) / 15를 weight.dtype으로 반올림한 뒤, 그 dtype의 가장 작은 정규수
             torch.finfo(weight.dtype).tiny 이상 (값이 모두 같은 그룹)
    z      = lo + 8 * s, s는 저장된 값, weight.dtype으로 반올림
    q      = torch.round((w - z) / s) + 8, s와 z는 저장된 값, [0, 15]로 클리핑

    packed: uint8 [out, in / 2], 바이트당 코드 두 개: 행의 바이트 i는 하위 4비트에 입력 2i의
    코드를, 상위 4비트에 입력 2i + 1의 코드를 담습니다
    scales, zeros: [out, in / group_size], weight.dtype

입력 크기가 나누어떨어지지 않는 그룹 크기는 둘을 모두 밝히는 ValueError로 거부합니다.

두 함수를 모두 작성하세요. 다음 명령으로 확인하세요:

    pytest lessons/exercises/test_weight_quant_exercise.py

테스트는 여러분의 코드, 스케일, 영점을 레퍼런스(reference/ops/weight_quant.py의 quantize_int4와
dequantize_weight)의 것과 비트 단위로 비교합니다. 또한 코드를 미리 아는 가중치로 패킹을, 그리고
왕복 오차(최대 반 간격, 곧 s / 2), 값이 모두 같은 그룹, 자기 그룹 안에 갇혀야 하는 이상치, 거부를
확인하고, 여러분의 바이트를 torch의 int4 커널로 돌려 봅니다. 이 파일을 고치기 전까지 테스트는
여러분의 버전을 skipped로 보고하고 해답만 확인합니다.
"""

import torch


def quantize_int4(weight: torch.Tensor,
                  group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [out, in] (float32 or bfloat16) -> (packed, scales, zeros), as the docstring
    above says: packed uint8 [out, in / 2]; scales and zeros [out, in / group_size] in
    weight.dtype."""
    # 1. Refuse a group size that does not divide the input size (ValueError naming both).
    # 2. View the rows as [out, groups, group_size] in float32; each group's min and max.
    # 3. The scale, rounded to weight.dtype, then clamped to at least its smallest normal
    #    (then back to float32: quantize with what is stored). The zero from the stored
    #    scale, rounded too.
    # 4. The codes: torch.round((w - z) / s) + 8, clipped to [0, 15], as uint8 [out, in].
    # 5. Pack: even inputs (codes[:, 0::2]) in the low nibble, odd ones shifted left by 4.
    raise NotImplementedError("exercise: implement quantize_int4")


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(packed, scales, zeros) as quantize_int4 returns them -> the weight [out, in] the codes
    stand for, computed in float32 and returned in dtype."""
    # Unpack: packed & 0xF is the even input, packed >> 4 the odd one; interleave them back
    # into [out, in]. Then (q - 8) * s + z per group, in float32, and convert to dtype.
    raise NotImplementedError("exercise: implement dequantize_int4")
