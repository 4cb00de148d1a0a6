"""What the reference model needs to know about a checkpoint, read from its config.json.

transformers parses the file (AutoConfig), so every field means exactly what it means to Hugging
Face; this module folds the families' different spellings into one flat ``ModelConfig``.
"""

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig

from .registry import resolve_model

# model_type in config.json -> the family of decoder the reference tier builds for it.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "opt")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # < num_heads: grouped-query attention (GQA); == num_heads: multi-head
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype: torch.dtype  # the dtype the weights were saved in
    # Llama family
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3" | "linear", ...} or None
    attention_bias: bool = False  # q, k, v projections carry a bias (Qwen2: yes)
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm on each head's q and k before RoPE (Qwen3)
    sliding_windows: tuple[int | None, ...] = ()  # per layer; None = full attention
    # OPT
    word_embed_proj_dim: int = 0
    do_layer_norm_before: bool = True  # pre-LN (every OPT but 350m)
    final_layer_norm: bool = True
    enable_bias: bool = True
    layer_norm_elementwise_affine: bool = True

    @property
    def is_opt(self) -> bool:
        return self.model_type == "opt"


def read_config_json(model_dir: str | Path) -> tuple[Path, dict]:
    """The folder's config.json as a dict, after checking it is a checkpoint of a supported
    family whose sizes a model can have; returns (path of config.json, its contents)."""
    if not isinstance(model_dir, str | os.PathLike):
        raise TypeError(f"model_dir must be a folder path (str or pathlib.Path), got "
                        f"{model_dir!r} ({type(model_dir).__name__})")
    if str(model_dir) == "":  # Path("") is the current folder: never what was meant
        raise ValueError("model folder is an empty string; pass the path of a Hugging Face "
                         "checkpoint folder (config.json and *.safetensors)")
    model_dir = Path(model_dir)
    if model_dir.is_file():
        raise ValueError(f"model folder {str(model_dir)!r} is a file, not a folder; pass the "
                         "folder that holds config.json and the *.safetensors files")
    if not model_dir.is_dir():
        raise ValueError(f"model folder {str(model_dir)!r} does not exist; pass a folder holding "
                         "a Hugging Face checkpoint (config.json and *.safetensors)")
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{str(model_dir)!r} has no config.json; a Hugging Face checkpoint "
                         "folder (as written by save_pretrained) is expected")
    try:
        raw = json.loads(config_file.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{config_file} is not valid JSON ({err}); it should be the JSON object "
                         "save_pretrained writes, e.g. {\"model_type\": \"llama\", ...}") from err
    if not isinstance(raw, dict):
        raise ValueError(f"{config_file} holds a JSON {type(raw).__name__}, not an object; it "
                         "should be the JSON object save_pretrained writes, e.g. "
                         "{\"model_type\": \"llama\", ...}")
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} in {config_file} is not supported; "
                         f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}")
    _check_sizes(raw, config_file)
    return config_file, raw


def read_model_type(model_dir: str | Path) -> str:
    """Check the folder holds a config.json of a supported family; return its model_type."""
    return read_config_json(model_dir)[1]["model_type"]


def _check_sizes(raw: dict, config_file: Path) -> None:
    """Refuse sizes no model can have, before transformers divides by them: it would fail with a
    ZeroDivisionError, or build a model with negative dimensions, without naming the file."""
    opt = raw["model_type"] == "opt"
    required = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "max_position_embeddings", "ffn_dim" if opt else "intermediate_size"]
    # null is allowed here: Mistral's configs write "head_dim": null, "sliding_window": null.
    optional = (["word_embed_proj_dim"] if opt
                else ["num_key_value_heads", "head_dim", "sliding_window"])
    for key in required + optional:
        if key not in raw or (raw[key] is None and key in optional):
            continue  # absent: transformers supplies the family's default (checked later)
        value = raw[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{config_file}: {key} must be a positive integer (>= 1), got "
                             f"{value!r}")
    hidden, heads = raw.get("hidden_size"), raw.get("num_attention_heads")
    kv_heads = raw.get("num_key_value_heads")
    # Qwen3 and Mistral may give head_dim != hidden_size / heads; OPT derives it, and
    # transformers' Llama config insists on the division even when head_dim is given.
    own_head_dim = raw["model_type"] not in ("opt", "llama")
    if hidden and heads and not (own_head_dim and raw.get("head_dim")) and hidden % heads:
        raise ValueError(f"{config_file}: hidden_size {hidden} is not divisible by "
                         f"num_attention_heads {heads}; each head gets hidden_size / "
                         f"num_attention_heads dimensions, so num_attention_heads must divide "
                         f"{hidden}" + (" (or give head_dim)" if own_head_dim else ""))
    if heads and kv_heads and heads % kv_heads:
        raise ValueError(f"{config_file}: num_attention_heads {heads} is not divisible by "
                         f"num_key_value_heads {kv_heads}; every KV head serves an equal group "
                         f"of query heads, so num_key_value_heads must divide {heads}")


def check_model_config(cfg: ModelConfig, source: str | Path = "config.json") -> None:
    """The same limits on the flattened config, defaults included (a field absent from the
    file takes transformers' default, which _check_sizes could not see)."""
    for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                "head_dim", "intermediate_size", "max_position_embeddings"):
        value = getattr(cfg, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{source}: {key} must be a positive integer (>= 1), got {value!r}")
    if cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(f"{source}: {cfg.num_heads} attention heads are not divisible by "
                         f"{cfg.num_kv_heads} KV heads; the KV head count must divide the "
                         "attention head count")
    if not cfg.dtype.is_floating_point:
        raise ValueError(f"{source}: dtype {cfg.dtype} is not a floating dtype; the reference "
                         "model computes in float32, float16 or bfloat16")


def load_config(model_dir: str | Path) -> ModelConfig:
    """The config of a checkpoint folder (or of a model name or GGUF file: see registry.py)."""
    config_file, _ = read_config_json(resolve_model(model_dir))
    try:
        hf = AutoConfig.from_pretrained(config_file.parent)
    except Exception as err:  # its own checks of the same file; whatever it refuses is the file's
        raise ValueError(f"{config_file} was refused by transformers: "
                         f"{type(err).__name__}: {err}") from err
    cfg = from_hf_config(hf, source=config_file)
    check_model_config(cfg, config_file)
    return cfg


def from_hf_config(hf, source: str | Path = "config.json") -> ModelConfig:
    """Flatten a transformers config object (any supported family) into a ModelConfig."""
    dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{source}: dtype {name!r} is not a torch dtype; save_pretrained "
                             "writes e.g. \"float32\", \"float16\" or \"bfloat16\"")
    if hf.model_type == "opt":
        return ModelConfig(
            model_type="opt", vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
            num_layers=hf.num_hidden_layers, num_heads=hf.num_attention_heads,
            num_kv_heads=hf.num_attention_heads,
            head_dim=hf.hidden_size // hf.num_attention_heads, intermediate_size=hf.ffn_dim,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=getattr(hf, "tie_word_embeddings", True), dtype=dtype,
            word_embed_proj_dim=hf.word_embed_proj_dim,
            do_layer_norm_before=hf.do_layer_norm_before,
            final_layer_norm=hf.do_layer_norm_before and not hf._remove_final_layer_norm,
            enable_bias=getattr(hf, "enable_bias", True),
            layer_norm_elementwise_affine=getattr(hf, "layer_norm_elementwise_affine", True),
        )
    if hf.hidden_act not in ("silu", "swish"):
        raise ValueError(f"{source}: hidden_act {hf.hidden_act!r} is not supported; the Llama "
                         "family uses 'silu'")
    # transformers >= 5 keeps theta and scaling together in rope_parameters; 4.x splits them.
    rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    theta = rope.pop("rope_theta", getattr(hf, "rope_theta", 10000.0))
    if rope.get("rope_type", rope.get("type", "default")) == "default":
        rope = {}
    num_layers = hf.num_hidden_layers
    window = getattr(hf, "sliding_window", None)
    layer_types = getattr(hf, "layer_types", None)
    if layer_types is not None:  # Qwen2/3: only layers marked "sliding_attention" slide
        windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
    else:  # Mistral: every layer slides when sliding_window is set
        windows = (window,) * num_layers
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    qkv_bias = hf.model_type == "qwen2" or getattr(hf, "attention_bias", False)
    return ModelConfig(
        model_type=hf.model_type, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
        num_layers=num_layers, num_heads=hf.num_attention_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
        head_dim=head_dim, intermediate_size=hf.intermediate_size,
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=getattr(hf, "tie_word_embeddings", False), dtype=dtype,
        rms_norm_eps=hf.rms_norm_eps, rope_theta=theta, rope_scaling=rope or None,
        attention_bias=qkv_bias,
        o_proj_bias=hf.model_type != "qwen2" and getattr(hf, "attention_bias", False),
        mlp_bias=getattr(hf, "mlp_bias", False), qk_norm=hf.model_type == "qwen3",
        sliding_windows=windows,
    )
