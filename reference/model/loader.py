"""Load a Hugging Face checkpoint folder into the reference model of its family.

A folder holds config.json and model.safetensors (or shards and their index). The family's
module tree uses Hugging Face's parameter names, so loading is building the tree on the meta
device (no memory, no random init) and assigning the saved tensors to it.
"""

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from ..ops.weight_quant import QuantizedWeight
from .config import ModelConfig, load_config
from .deepseek_v2 import DeepseekV2ForCausalLM
from .gemma3 import Gemma3ForCausalLM
from .llama import LlamaForCausalLM
from .opt import OPTForCausalLM
from .quantized_checkpoint import split_saved
from .registry import FLOAT_DTYPES, resolve_model
from .weights import load_state_dict_and_sources

ARCHITECTURES = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM,
                 "qwen2": LlamaForCausalLM, "qwen3": LlamaForCausalLM, "opt": OPTForCausalLM,
                 "gemma3_text": Gemma3ForCausalLM, "deepseek_v2": DeepseekV2ForCausalLM}


def build_model(cfg: ModelConfig, state: Mapping[str, torch.Tensor],
                sources: Mapping[str, str | Path] | None = None) -> nn.Module:
    """The model of cfg holding the tensors of state; sources (tensor name -> file it came
    from) only makes the errors name the file."""
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a ModelConfig (from load_config), got "
                        f"{type(cfg).__name__}")
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a dict of tensor name -> tensor, got "
                        f"{type(state).__name__}")
    if cfg.model_type not in ARCHITECTURES:
        raise ValueError(f"model_type {cfg.model_type!r} is not supported; supported model "
                         f"types: {', '.join(ARCHITECTURES)}")
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"state[{name!r}] must be a torch.Tensor, got "
                            f"{type(tensor).__name__}")
    sources = sources or {}
    with torch.device("meta"):
        model = ARCHITECTURES[cfg.model_type](cfg)
    state = dict(state)
    embed_key = ("model.decoder.embed_tokens.weight" if cfg.is_opt
                 else "model.embed_tokens.weight")
    if "lm_head.weight" not in state and cfg.tie_word_embeddings and embed_key in state:
        state["lm_head.weight"] = state[embed_key]  # tied: the output layer is the embedding
        if embed_key in sources:
            sources = {**sources, "lm_head.weight": sources[embed_key]}
    where = _where(sources.values())
    expected = model.state_dict()
    missing, unexpected = set(expected) - set(state), set(state) - set(expected)
    if missing or unexpected:
        raise ValueError(f"the checkpoint{where} does not match the {cfg.model_type} model its "
                         f"config describes: missing {sorted(missing)[:8]} ({len(missing)}), "
                         f"unexpected {sorted(unexpected)[:8]} ({len(unexpected)}); config.json "
                         "and the weights must come from the same save_pretrained")
    # load_state_dict(assign=True) would report a wrong shape without the file; compare first.
    wrong = [name for name, tensor in state.items() if tensor.shape != expected[name].shape]
    if wrong:
        name = wrong[0]
        more = f" ({len(wrong) - 1} more tensors differ too)" if len(wrong) > 1 else ""
        source = f" in {sources[name]}" if name in sources else ""
        raise ValueError(f"tensor {name!r}{source} has shape {tuple(state[name].shape)}, but the "
                         f"{cfg.model_type} model its config describes expects "
                         f"{tuple(expected[name].shape)}{more}; config.json and the weights must "
                         "come from the same checkpoint")
    model.load_state_dict(state, assign=True)
    return model.eval()


def _where(files) -> str:
    names = sorted({str(f) for f in files})
    if not names:
        return ""
    return f" in {names[0]}" if len(names) == 1 else f" in {Path(names[0]).parent}"


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """float32, float16 or bfloat16 (a name, with or without "torch.", or the torch.dtype)."""
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype in FLOAT_DTYPES.values()):
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in FLOAT_DTYPES:
        return FLOAT_DTYPES[dtype.removeprefix("torch.")]
    if not isinstance(dtype, str | torch.dtype):
        raise TypeError(f"dtype must be a name such as 'float16' or a torch.dtype, got "
                        f"{dtype!r} ({type(dtype).__name__})")
    raise ValueError(f"dtype {str(dtype)!r} is not supported; the model computes in a floating "
                     f"dtype: choose one of {', '.join(FLOAT_DTYPES)}")


def parse_device(device: str | torch.device) -> torch.device:
    if not isinstance(device, str | torch.device):
        raise TypeError(f"device must be a name such as 'cpu' or 'cuda:0', or a torch.device, "
                        f"got {device!r} ({type(device).__name__})")
    try:
        device = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"device {device!r} is not a torch device ({err}); use e.g. 'cpu', "
                         "'cuda' or 'cuda:0'") from err
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {str(device)!r}: the engine runs on 'cpu' or 'cuda' "
                         "(e.g. 'cuda:0')")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} asks for a CUDA GPU, but none is visible; "
                         "use device='cpu'")
    return device


def load_model(model_dir: str | Path, dtype: torch.dtype | str | None = None,
               device: str | torch.device = "cpu") -> nn.Module:
    """The reference model for a checkpoint folder (or a model name, or a GGUF file: see
    registry.py); weights cast to dtype (default: as saved). A quantized checkpoint's layers
    come back dequantized (``load_model_and_saved`` also gives their saved codes)."""
    return load_model_and_saved(model_dir, dtype, device)[0]


def load_model_and_saved(model_dir: str | Path, dtype: torch.dtype | str | None = None,
                         device: str | torch.device = "cpu"
                         ) -> tuple[nn.Module, dict[str, QuantizedWeight]]:
    """load_model's model, and {layer name: QuantizedWeight} the layers a quantized
    checkpoint (``pagedllm quantize``'s) saves quantized; {} for a float checkpoint."""
    dtype = parse_dtype(dtype)  # before any file is read: a typo should fail at once
    device = parse_device(device)
    model_dir = resolve_model(model_dir, dtype)
    cfg = load_config(model_dir)
    dtype = dtype or cfg.dtype
    state, sources = load_state_dict_and_sources(model_dir)
    saved = {}
    if cfg.quantization is not None:  # before the cast: the codes are not floats
        state, saved = split_saved(state, cfg.quantization, dtype)
        saved = {name: replace(qw, qweight=qw.qweight.to(device), scales=qw.scales.to(device))
                 for name, qw in saved.items()}
    state = {k: t.to(device=device, dtype=dtype) for k, t in state.items()}
    return build_model(cfg, state, sources), saved


def load_tokenizer(model_dir: str | Path):
    """The checkpoint folder's tokenizer, or None when it has none (prompts as token ids)."""
    model_dir = Path(model_dir)
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
