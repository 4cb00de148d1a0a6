"""What the reference model needs to know about a checkpoint, read from its config.json.

transformers parses the file (AutoConfig), so every field means exactly what it means to Hugging
Face; this module folds the families' different spellings into one flat ``ModelConfig``.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig

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


def read_model_type(model_dir: str | Path) -> str:
    """Check the folder holds a config.json of a supported family; return its model_type."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ValueError(f"model folder {str(model_dir)!r} does not exist; pass a folder holding "
                         "a Hugging Face checkpoint (config.json and *.safetensors)")
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{str(model_dir)!r} has no config.json; a Hugging Face checkpoint "
                         "folder (as written by save_pretrained) is expected")
    model_type = json.loads(config_file.read_text()).get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} in {config_file} is not supported; "
                         f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return model_type


def load_config(model_dir: str | Path) -> ModelConfig:
    read_model_type(model_dir)
    return from_hf_config(AutoConfig.from_pretrained(model_dir))


def from_hf_config(hf) -> ModelConfig:
    """Flatten a transformers config object (any supported family) into a ModelConfig."""
    dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
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
        raise ValueError(f"hidden_act {hf.hidden_act!r} is not supported; the Llama family "
                         "uses 'silu'")
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
