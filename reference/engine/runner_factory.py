"""Which model runner an engine gets: decided once, from its config (vLLM's executor choice).

The tier is ``config.model_runner`` (the reference's readable runner, or the optimized one).
With ``tensor_parallel_size > 1`` that runner runs rank 0's shard inside a
``TensorParallelRunner``, which drives the other ranks through the same methods. The engine
calls this factory and never asks what it got: tensor parallelism lives behind the runner.
"""

import torch

from ..model.rank_loader import load_rank_model
from .parallel_runner import TensorParallelRunner, run_torchrun_worker, torchrun_rank


def create_model_runner(config, model: torch.nn.Module):
    """The runner for `model` (the whole model, or rank 0's shard when tensor-parallel)."""
    runner = config.model_runner(model, config)
    if config.tensor_parallel_size > 1:  # the other ranks start here
        runner = TensorParallelRunner(runner, config)
    return runner


def load_engine_model(config) -> torch.nn.Module:
    """The model rank 0 runs. Under torchrun every rank runs the caller's script: on ranks
    1..N-1 this call becomes that rank's worker, which serves rank 0's steps and ends the
    process with it (SystemExit)."""
    if config.tensor_parallel_size > 1 and torchrun_rank():
        run_torchrun_worker(config)
        raise SystemExit(0)
    return load_rank_model(config, rank=0)
