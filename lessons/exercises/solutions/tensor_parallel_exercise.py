"""Solution to lesson 19's exercise: a linear layer split column-wise and row-wise over N
simulated ranks, and the Megatron pair (column then row) on the Llama MLP, as
reference/model/tensor_parallel.py splits them (shard_range, narrow_model, RowParallelLinear)."""

import torch
import torch.nn.functional as F


def shard_range(size: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, end) of rank's contiguous part of `size` items: sizes differ by at most one."""
    if world_size < 1 or world_size > size:
        raise ValueError(f"world_size {world_size} does not split {size} items: use 1 to "
                         f"{size} ranks")
    return size * rank // world_size, size * (rank + 1) // world_size


def column_parallel_shards(weight: torch.Tensor, bias: torch.Tensor | None,
                           world_size: int) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Rank r's output rows of weight [out, in] and of bias [out]."""
    out = weight.shape[0]
    shards = []
    for rank in range(world_size):
        start, end = shard_range(out, rank, world_size)
        shards.append((weight[start:end], None if bias is None else bias[start:end]))
    return shards


def row_parallel_shards(weight: torch.Tensor, bias: torch.Tensor | None,
                        world_size: int) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Rank r's input columns of weight [out, in]; the bias on rank 0 only (added once)."""
    inp = weight.shape[1]
    shards = []
    for rank in range(world_size):
        start, end = shard_range(inp, rank, world_size)
        shards.append((weight[:, start:end], bias if rank == 0 else None))
    return shards


def column_parallel_linear(x: torch.Tensor,
                           shards: list[tuple[torch.Tensor, torch.Tensor | None]]) -> torch.Tensor:
    """Each rank's outputs from the whole x [T, in], concatenated: [T, out]."""
    return torch.cat([F.linear(x, w, b) for w, b in shards], dim=-1)


def row_parallel_linear(x: torch.Tensor,
                        shards: list[tuple[torch.Tensor, torch.Tensor | None]]) -> torch.Tensor:
    """Each rank's partial sum from its slice of x's inputs, added over ranks: [T, out]."""
    partials, offset = [], 0
    for w, b in shards:
        width = w.shape[1]
        partials.append(F.linear(x[..., offset:offset + width], w, b))  # [T, out]
        offset += width
    return torch.stack(partials).sum(dim=0)  # the all-reduce


def parallel_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                 world_size: int) -> torch.Tensor:
    """down(SiLU(gate(x)) * up(x)): gate and up by outputs, down by inputs, one sum."""
    inter = gate.shape[0]
    partials = []
    for rank in range(world_size):
        start, end = shard_range(inter, rank, world_size)  # this rank's units
        h = F.silu(x @ gate[start:end].T) * (x @ up[start:end].T)  # [T, my units]
        partials.append(h @ down[:, start:end].T)  # [T, hidden]: a partial sum
    return torch.stack(partials).sum(dim=0)
