"""Read a checkpoint's tensors from safetensors files: one model.safetensors, or shards listed
in model.safetensors.index.json (what save_pretrained writes for large models)."""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file


def load_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (model_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{str(model_dir)!r} has neither model.safetensors nor "
                         "model.safetensors.index.json; save the model with save_pretrained "
                         "(safetensors is its default format)")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(model_dir / name))
    return state
