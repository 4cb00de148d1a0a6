"""The model one engine rank runs: the whole checkpoint, or its tensor-parallel shard.

An engine of one rank loads the whole model; with ``tensor_parallel_size=N`` rank r reads only
its slices of each weight (``tensor_parallel.py``). Either way the weights are then quantized as
the engine's config says, layer by layer, so that the float copy is never whole in memory.
``config`` is the engine's (``EngineConfig``); this package does not import the engine, it
reads the fields it needs.
"""

import torch
from torch import nn

from .gguf import converted_from
from .loader import load_model_and_saved
from .quantization import quantize_model
from .tensor_parallel import load_model_shard, row_parallel_absmax


def rank_device(config, rank: int) -> torch.device:
    """One GPU per rank (cuda:0, cuda:1, ...); every rank of a CPU engine on the CPU."""
    return torch.device("cuda", rank) if config.device.type == "cuda" else config.device


def load_rank_model(config, rank: int = 0) -> nn.Module:
    """The model rank `rank` runs: the whole checkpoint, or its shard when the engine is
    tensor-parallel (its slices read, nothing else); quantized as the config says."""
    tp, saved = config.tensor_parallel_size, {}
    if tp == 1:  # a quantized checkpoint's saved codes are put in place as they are
        model, saved = load_model_and_saved(config.model_dir, config.dtype, config.device)
    else:
        model = load_model_shard(config.model_dir, rank, tp, config.dtype,
                                 rank_device(config, rank))
    if config.quantization is not None:  # the float weights are dropped layer by layer
        # int8 and fp8 scale whole rows, which a row-parallel shard holds a slice of
        row_absmax = row_parallel_absmax(model, config.model_dir, config.dtype) \
            if tp > 1 and config.quantization in ("int8", "fp8") else None
        model = quantize_model(model, config.quantization, config.quantization_group_size,
                               config.quantization_skip, converted_from(config.model_dir),
                               row_absmax, saved)
    return model
