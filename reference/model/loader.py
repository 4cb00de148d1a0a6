"""Load a Hugging Face checkpoint folder into the reference model of its family.

A folder holds config.json and model.safetensors (or shards and their index). The family's
module tree uses Hugging Face's parameter names, so loading is building the tree on the meta
device (no memory, no random init) and assigning the saved tensors to it.
"""

from pathlib import Path

import torch
from torch import nn

from .config import ModelConfig, load_config
from .llama import LlamaForCausalLM
from .opt import OPTForCausalLM
from .weights import load_state_dict

ARCHITECTURES = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM,
                 "qwen2": LlamaForCausalLM, "qwen3": LlamaForCausalLM, "opt": OPTForCausalLM}


def build_model(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> nn.Module:
    with torch.device("meta"):
        model = ARCHITECTURES[cfg.model_type](cfg)
    state = dict(state)
    embed_key = ("model.decoder.embed_tokens.weight" if cfg.is_opt
                 else "model.embed_tokens.weight")
    if "lm_head.weight" not in state and cfg.tie_word_embeddings:
        state["lm_head.weight"] = state[embed_key]  # tied: the output layer is the embedding
    expected = set(model.state_dict())
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match a {cfg.model_type} model of this config: "
                         f"missing {sorted(missing)[:8]}, unexpected {sorted(unexpected)[:8]}")
    model.load_state_dict(state, assign=True)
    return model.eval()


def load_model(model_dir: str | Path, dtype: torch.dtype | str | None = None,
               device: str | torch.device = "cpu") -> nn.Module:
    """The reference model for a checkpoint folder; weights cast to dtype (default: as saved)."""
    cfg = load_config(model_dir)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    dtype = dtype or cfg.dtype
    state = {k: t.to(device=device, dtype=dtype) for k, t in load_state_dict(model_dir).items()}
    return build_model(cfg, state)
