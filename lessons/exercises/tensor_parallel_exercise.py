"""Exercise (lesson 19, "Splitting the model"): a linear layer split over N ranks, column-wise
and row-wise, simulated with plain tensors (no processes).

A linear layer computes y = x @ W.T + b with W of shape [out, in] (torch's layout: row n holds
the weights of output n). Tensor parallelism gives each of N ranks a contiguous part of W:

    column-parallel: rank r holds rows [start, end) of W (and of b): its own OUTPUTS.
        Each rank computes y[:, start:end] from the whole x; concatenating the N results
        (an all-gather) gives y. Nothing is summed.
    row-parallel: rank r holds columns [start, end) of W: its own INPUTS. Each rank
        multiplies its slice x[:, start:end] by its columns and gets a partial sum of the
        whole y; adding the N partials (an all-reduce) gives y. The bias is added once, by
        rank 0 only, or the sum would count it N times.

Megatron-LM pairs the two: the first product of a block column-parallel, the second
row-parallel, so that the activations in between never leave their rank. The MLP below is
that pair: gate and up split by outputs, SiLU(gate) * up computed per rank on its own units,
down split by inputs, one sum at the end.

Parts are contiguous and differ in size by at most one, rank r taking
[size * r // N, size * (r + 1) // N) (so 10 over 3 ranks is 3, 3 and 4). A world size below 1
or above the dimension being split is refused with a ValueError that names both.

Write the five functions. Check your work with

    pytest lessons/exercises/test_tensor_parallel_exercise.py

The test compares your ranges with reference/model/tensor_parallel.py's shard_range, checks
that each rank holds only its part (1/N of the weights, the row-parallel bias on rank 0 only),
that concatenation and the sum of partial products give the full layer's output (to float32
rounding, since a sum in another order rounds differently), for even and uneven splits and for
N from 1 to the layer's size, and that the parallel MLP matches the whole one. Until you edit
this file the test reports your version as skipped and checks only the solution.

한국어:
연습 문제(19강, "모델 나누기"): 선형 레이어 하나를 N개 랭크에 열 방향과 행 방향으로 나누기를,
프로세스 없이 일반 텐서로 흉내 냅니다.

선형 레이어는 y = x @ W.T + b를 계산하며 W의 모양은 [out, in]입니다(torch의 배치: 행 n에는 출력
n의 가중치가 들어 있습니다). 텐서 병렬화는 N개 랭크 각각에 W의 연속된 한 부분을 줍니다.

    열 병렬(column-parallel): 랭크 r은 W(와 b)의 행 [start, end), 곧 자기 몫의 *출력*을
        가집니다. 각 랭크는 x 전체로 y[:, start:end]를 계산하고, N개 결과를 이어 붙이면(올
        개더, all-gather) y가 됩니다. 더하는 것은 없습니다.
    행 병렬(row-parallel): 랭크 r은 W의 열 [start, end), 곧 자기 몫의 *입력*을 가집니다. 각
        랭크는 자기 조각 x[:, start:end]에 자기 열을 곱해 y 전체의 부분합을 얻고, N개 부분합을
        더하면(올리듀스, all-reduce) y가 됩니다. 편향은 랭크 0만 한 번 더합니다. 그러지 않으면
        합에 N번 들어갑니다.

Megatron-LM은 둘을 짝지어, 블록의 첫 곱은 열 병렬로, 둘째 곱은 행 병렬로 나눕니다. 그러면 그
사이의 활성값은 자기 랭크를 떠나지 않습니다. 아래 MLP가 그 짝입니다. gate와 up은 출력으로
나누고, SiLU(gate) * up은 랭크마다 자기 유닛에서 계산하며, down은 입력으로 나누고, 끝에서 한 번
더합니다.

조각은 연속이고 크기 차이는 많아야 하나이며, 랭크 r은 [size * r // N, size * (r + 1) // N)을
가집니다(그래서 10을 랭크 3개로 나누면 3, 3, 4). 월드 크기가 1보다 작거나 나누는 차원보다 크면
둘을 모두 밝히는 ValueError로 거부합니다.

다섯 함수를 작성하세요. 다음 명령으로 확인하세요:

    pytest lessons/exercises/test_tensor_parallel_exercise.py

테스트는 여러분의 범위를 reference/model/tensor_parallel.py의 shard_range와 비교하고, 각 랭크가
자기 몫만 가지는지(가중치의 1/N, 행 병렬 편향은 랭크 0에만), 이어 붙이기와 부분곱의 합이 레이어
전체의 출력과 같은지(다른 순서의 합은 다르게 반올림되므로 float32 반올림 오차 안에서), 고른 분할과
고르지 않은 분할, 1부터 레이어 크기까지의 N에서 확인하고, 병렬 MLP가 전체 MLP와 같은지
확인합니다. 이 파일을 고치기 전까지 테스트는 여러분의 버전을 skipped로 보고하고 해답만
확인합니다.
"""

import torch


def shard_range(size: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, end) of rank's contiguous part of `size` items: sizes differ by at most one.
    ValueError (naming both numbers) unless 1 <= world_size <= size."""
    # 1. Refuse world_size < 1 or world_size > size.
    # 2. start = size * rank // world_size, end = size * (rank + 1) // world_size.
    raise NotImplementedError("exercise: implement shard_range")


def column_parallel_shards(weight: torch.Tensor, bias: torch.Tensor | None,
                           world_size: int) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """[(weight_r, bias_r)] for r in 0..N-1: rank r's output rows of weight [out, in] and of
    bias [out] (None stays None)."""
    # shard_range over `out`; weight[start:end] and bias[start:end].
    raise NotImplementedError("exercise: implement column_parallel_shards")


def row_parallel_shards(weight: torch.Tensor, bias: torch.Tensor | None,
                        world_size: int) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """[(weight_r, bias_r)] for r in 0..N-1: rank r's input columns of weight [out, in]; the
    whole bias on rank 0, None on every other rank."""
    # shard_range over `in`; weight[:, start:end]; bias only where r == 0.
    raise NotImplementedError("exercise: implement row_parallel_shards")


def column_parallel_linear(x: torch.Tensor,
                           shards: list[tuple[torch.Tensor, torch.Tensor | None]]) -> torch.Tensor:
    """x [T, in], the whole input on every rank -> y [T, out]: each rank's outputs, then the
    N pieces concatenated along the last dimension (what an all-gather assembles)."""
    # torch.nn.functional.linear(x, w_r, b_r) per rank; torch.cat(..., dim=-1).
    raise NotImplementedError("exercise: implement column_parallel_linear")


def row_parallel_linear(x: torch.Tensor,
                        shards: list[tuple[torch.Tensor, torch.Tensor | None]]) -> torch.Tensor:
    """x [T, in], the whole input -> y [T, out]: rank r multiplies its slice of x's inputs
    (the columns its weight holds) by its weight, and the N partial sums are added (what an
    all-reduce computes). Find each rank's slice from its weight's width."""
    # Walk the shards, keeping a running offset into x's last dimension:
    # partial_r = F.linear(x[:, offset:offset + w_r.shape[1]], w_r, b_r); y = sum of partials.
    raise NotImplementedError("exercise: implement row_parallel_linear")


def parallel_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                 world_size: int) -> torch.Tensor:
    """The Llama MLP, down(SiLU(gate(x)) * up(x)) with weights gate and up [inter, hidden]
    and down [hidden, inter] (no biases), split over world_size ranks: gate and up
    column-parallel, down row-parallel. Each rank computes its own units from the whole x and
    its own partial sum; the result is the sum over ranks. One sum, nothing in between."""
    # Per rank: g = x @ gate_r.T, u = x @ up_r.T (its units), h = F.silu(g) * u,
    # partial = h @ down_r.T with down_r = down[:, its units]. Return the sum of partials.
    raise NotImplementedError("exercise: implement parallel_mlp")
