"""Checks lesson 19's exercise: a linear layer split over N ranks, column-wise and row-wise.

    pytest lessons/exercises/test_tensor_parallel_exercise.py

Each test runs twice: against the solution (always) and against your file,
lessons/exercises/tensor_parallel_exercise.py (skipped while a function it needs still raises
NotImplementedError). conftest.py loads both by file path, so lessons/ needs no __init__.py.

The reference is reference/model/tensor_parallel.py: shard_range, and narrow_model, which cuts
every layer of a model to one rank's part. Why the tolerances: a column-parallel output is the
very dot product the whole layer computes, only fewer of them per rank; a row-parallel output
is a sum of N partial sums, the same terms added in another order, so it matches the whole
product to float32 rounding and not bit for bit (the engine's logits on N ranks differ from one
rank's by a few 1e-6 for the same reason).
"""

import pytest
import torch
import torch.nn.functional as F

from pagedllm.reference.model import tensor_parallel
from pagedllm.reference.model.config import load_config
from pagedllm.reference.model.loader import ARCHITECTURES

EXERCISE = "tensor_parallel_exercise"  # impl (conftest.py): the solution's file, then yours
TINY = "pagedllm/models/tiny-pydoc"
ROUNDING = dict(rtol=1e-5, atol=1e-5)  # float32, a sum of partial sums in another order


@pytest.fixture
def shard_range(impl):
    return impl.use("shard_range", 4, 0, 2)


@pytest.fixture
def column_shards(impl):
    return impl.use("column_parallel_shards", torch.ones(4, 2), None, 2)


@pytest.fixture
def row_shards(impl):
    return impl.use("row_parallel_shards", torch.ones(2, 4), None, 2)


@pytest.fixture
def column_linear(impl):
    return impl.use("column_parallel_linear", torch.ones(1, 3), [(torch.ones(2, 3), None)])


@pytest.fixture
def row_linear(impl):
    return impl.use("row_parallel_linear", torch.ones(1, 3), [(torch.ones(2, 3), None)])


@pytest.fixture
def mlp(impl):
    return impl.use("parallel_mlp", torch.ones(1, 4), torch.ones(6, 4), torch.ones(6, 4),
                    torch.ones(4, 6), 2)


def layer(out: int, inp: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A weight [out, inp], a bias [out] and an input [5, inp]."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(out, inp, generator=g), torch.randn(out, generator=g),
            torch.randn(5, inp, generator=g))


def test_your_ranges_are_the_references(shard_range):
    for size in range(1, 13):
        for world in range(1, size + 1):
            ranges = [shard_range(size, r, world) for r in range(world)]
            want = [tensor_parallel.shard_range(size, r, world) for r in range(world)]
            assert ranges == want, (
                f"{size} over {world} ranks: {ranges}, expected {want} "
                "(rank r takes [size * r // N, size * (r + 1) // N))"
                f"\n{size}개를 랭크 {world}개로: {ranges}, 기대값 {want}")
            sizes = [end - start for start, end in ranges]
            assert max(sizes) - min(sizes) <= 1, ("sizes differ by at most one"
                                                  "\n크기 차이는 많아야 하나")
    assert [shard_range(10, r, 3) for r in range(3)] == [(0, 3), (3, 6), (6, 10)]


@pytest.mark.parametrize("world", [0, 7])
def test_a_world_size_that_does_not_split_is_refused(shard_range, world):
    with pytest.raises(ValueError) as caught:
        shard_range(6, 0, world)
    message = str(caught.value)
    assert str(world) in message and "6" in message, (
        f"name the world size and the size it cannot split; got {message!r}"
        f"\n나눌 수 없는 월드 크기와 크기를 둘 다 밝히세요; 받은 메시지 {message!r}")


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_column_shards_hold_their_outputs(column_shards, world):
    weight, bias, _ = layer(10, 6)
    shards = column_shards(weight, bias, world)
    assert len(shards) == world, "one shard per rank\n랭크마다 조각 하나"
    row = 0
    for rank, (w, b) in enumerate(shards):
        start, end = tensor_parallel.shard_range(10, rank, world)
        assert w.shape == (end - start, 6), (
            f"rank {rank} holds outputs {start}..{end - 1}: rows of weight [out, in], every "
            f"input\n랭크 {rank}는 출력 {start}..{end - 1}을 가집니다: weight [out, in]의 행, "
            "입력은 전부")
        assert torch.equal(w, weight[start:end]) and torch.equal(b, bias[start:end])
        row += w.shape[0]
    assert row == 10, "the shards cover every output once\n조각들은 모든 출력을 한 번씩 덮습니다"
    assert column_shards(weight, None, world)[0][1] is None, "no bias stays no bias"


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_row_shards_hold_their_inputs_and_rank_0_the_bias(row_shards, world):
    weight, bias, _ = layer(6, 10)
    shards = row_shards(weight, bias, world)
    assert len(shards) == world, "one shard per rank\n랭크마다 조각 하나"
    for rank, (w, b) in enumerate(shards):
        start, end = tensor_parallel.shard_range(10, rank, world)
        assert w.shape == (6, end - start), (
            f"rank {rank} holds inputs {start}..{end - 1}: columns of weight [out, in], every "
            f"output\n랭크 {rank}는 입력 {start}..{end - 1}을 가집니다: weight [out, in]의 열, "
            "출력은 전부")
        assert torch.equal(w, weight[:, start:end])
        if rank == 0:
            assert b is not None and torch.equal(b, bias), ("rank 0 keeps the whole bias"
                                                            "\n랭크 0이 편향 전체를 가집니다")
        else:
            assert b is None, (f"rank {rank} has a bias: the sum over ranks would add it "
                               f"{world} times\n랭크 {rank}에 편향이 있습니다: 랭크 합에 "
                               f"{world}번 더해집니다")


@pytest.mark.parametrize("world", [1, 2, 3, 4, 12])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_concatenation_gives_the_full_product(column_shards, column_linear, world, with_bias):
    weight, bias, x = layer(12, 7)
    bias = bias if with_bias else None
    y = column_linear(x, column_shards(weight, bias, world))
    assert y.shape == (5, 12), "y is [T, out]: the ranks' outputs side by side"
    torch.testing.assert_close(y, F.linear(x, weight, bias), **ROUNDING)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_the_sum_of_partial_products_gives_the_full_product(row_shards, row_linear, world,
                                                            with_bias):
    weight, bias, x = layer(6, 7)
    bias = bias if with_bias else None
    y = row_linear(x, row_shards(weight, bias, world))
    assert y.shape == (5, 6), ("every rank's partial sum is a whole [T, out]: they add up"
                               "\n랭크마다의 부분합은 온전한 [T, out]입니다: 그것들을 더합니다")
    torch.testing.assert_close(y, F.linear(x, weight, bias), **ROUNDING)


def test_the_bias_is_added_once(row_shards, row_linear):
    weight, x = torch.zeros(3, 8), torch.randn(2, 8)
    bias = torch.tensor([1.0, 2.0, 3.0])
    y = row_linear(x, row_shards(weight, bias, 4))
    assert torch.equal(y, bias.expand(2, 3)), (
        f"zero weights, bias [1, 2, 3] over 4 ranks gave {y[0].tolist()}: the bias belongs to "
        f"one rank's partial sum\n가중치 0, 편향 [1, 2, 3]을 랭크 4개로 나눈 결과가 "
        f"{y[0].tolist()}입니다: 편향은 한 랭크의 부분합에만 들어갑니다")


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_the_parallel_mlp_is_the_whole_mlp(mlp, world):
    g = torch.Generator().manual_seed(3)
    hidden, inter = 8, 10  # 10 units over 3 ranks: 3, 3 and 4
    gate, up = torch.randn(inter, hidden, generator=g), torch.randn(inter, hidden, generator=g)
    down = torch.randn(hidden, inter, generator=g)
    x = torch.randn(4, hidden, generator=g)
    want = (F.silu(x @ gate.T) * (x @ up.T)) @ down.T
    torch.testing.assert_close(mlp(x, gate, up, down, world), want, **ROUNDING)


def test_your_shards_are_the_ones_the_engine_loads(column_shards, row_shards):
    """narrow_model cuts the tiny model's layers for rank r of 2: your shards must have the
    shapes it gives gate_proj (column-parallel) and down_proj (row-parallel)."""
    cfg = load_config(TINY)
    for rank in range(2):
        with torch.device("meta"):
            model = ARCHITECTURES[cfg.model_type](cfg)
        tensor_parallel.narrow_model(model, rank, 2)
        mlp_r = model.model.layers[0].mlp
        gate = torch.zeros(cfg.intermediate_size, cfg.hidden_size)
        down = torch.zeros(cfg.hidden_size, cfg.intermediate_size)
        assert column_shards(gate, None, 2)[rank][0].shape == mlp_r.gate_proj.weight.shape
        assert row_shards(down, None, 2)[rank][0].shape == mlp_r.down_proj.weight.shape
