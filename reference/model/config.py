"""What the reference model needs to know about a checkpoint, read from its config.json.

transformers parses the file (AutoConfig), so every field means exactly what it means to Hugging
Face; this module folds the families' different spellings into one flat ``ModelConfig``.
"""

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import AutoConfig

from .quantized_checkpoint import saved_scheme
from .registry import resolve_model
from .rope import SUPPORTED_ROPE_TYPES

# model_type in config.json -> the family of decoder the reference tier builds for it.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "opt", "gemma3_text",
                         "deepseek_v2")


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
    # Gemma 3
    # layer i's RoPE (theta, scaling) where layers differ (Gemma 3's sliding layers turn at a
    # base of their own); () = every layer has rope_theta and rope_scaling
    layer_ropes: tuple[tuple[float, dict | None], ...] = ()
    query_pre_attn_scalar: float | None = None  # attention scale: its -1/2 power
    final_logit_softcapping: float | None = None  # logits become cap * tanh(logits / cap)
    # DeepSeek-V2 multi-head latent attention (MLA, model/deepseek_v2.py); 0: not MLA.
    # num_kv_heads = num_heads and head_dim = qk_nope + qk_rope: the expanded form's K.
    kv_lora_rank: int = 0  # c_kv, the latent cached per token (with k_pe)
    q_lora_rank: int | None = None  # None: q_proj; a rank: q_a_proj -> norm -> q_b_proj
    qk_nope_head_dim: int = 0  # each head's key part decompressed from c_kv
    qk_rope_head_dim: int = 0  # the rotated part, k_pe, one head shared by all
    v_head_dim: int = 0
    # OPT
    word_embed_proj_dim: int = 0
    do_layer_norm_before: bool = True  # pre-LN (every OPT but 350m)
    # the scheme a `pagedllm quantize` folder saves its linear layers in; None: float weights
    quantization: str | None = None
    final_layer_norm: bool = True
    enable_bias: bool = True
    layer_norm_elementwise_affine: bool = True

    @property
    def is_opt(self) -> bool:
        return self.model_type == "opt"

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0


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
    saved = saved_scheme(getattr(hf, "quantization_config", None), config_file)
    return replace(cfg, quantization=saved) if saved else cfg


def from_hf_config(hf, source: str | Path = "config.json") -> ModelConfig:
    """Flatten a transformers config object (any supported family) into a ModelConfig."""
    dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{source}: dtype {name!r} is not a torch dtype; save_pretrained "
                             "writes e.g. \"float32\", \"float16\" or \"bfloat16\"")
    if hf.model_type == "gemma3_text":
        return _gemma3_config(hf, dtype, source)
    if hf.model_type == "deepseek_v2":
        return _deepseek_v2_config(hf, dtype, source)
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


def _gemma3_config(hf, dtype: torch.dtype, source: str | Path) -> ModelConfig:
    """Gemma 3's text decoder (Gemma3TextConfig): a RoPE per layer type, and the options the
    reference does not run refused by name, before a model computes something else."""
    if hf.hidden_activation != "gelu_pytorch_tanh":  # the exact op; "gelu_new" rounds apart
        raise ValueError(f"{source}: hidden_activation {hf.hidden_activation!r} is not "
                         "supported; Gemma 3 uses 'gelu_pytorch_tanh' (GELU, tanh approximation)")
    if hf.attn_logit_softcapping is not None:  # the attention ops take no cap on the scores
        raise ValueError(f"{source}: attn_logit_softcapping {hf.attn_logit_softcapping!r} is "
                         "not supported: the attention ops do not cap scores; Gemma 3 "
                         "checkpoints set it to null")
    if getattr(hf, "use_bidirectional_attention", False):  # also halves sliding_window in hf
        raise ValueError(f"{source}: use_bidirectional_attention true is not supported: the "
                         "engine generates left to right, with causal attention; set it to "
                         "false (Gemma 3's own value)")
    for name in ("query_pre_attn_scalar", "final_logit_softcapping"):
        value = getattr(hf, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                  or value <= 0):
            raise ValueError(f"{source}: {name} must be a positive number, got {value!r}")
    ropes = {}
    for kind in dict.fromkeys(hf.layer_types):
        if kind not in ("sliding_attention", "full_attention"):
            raise ValueError(f"{source}: layer_types holds {kind!r}; Gemma 3's layers are "
                             "'sliding_attention' or 'full_attention'")
        rope = dict(hf.rope_parameters[kind])
        theta, rope_type = rope.pop("rope_theta"), rope.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES or rope.get("partial_rotary_factor", 1) != 1:
            raise ValueError(f"{source}: rope_parameters[{kind!r}] {rope} is not supported; "
                             f"rope_type one of {', '.join(SUPPORTED_ROPE_TYPES)}, every "
                             "feature rotated (no partial_rotary_factor)")
        ropes[kind] = (theta, None if rope_type == "default" else rope)
    layer_types = tuple(hf.layer_types)
    if len(layer_types) != hf.num_hidden_layers:
        raise ValueError(f"{source}: layer_types names {len(layer_types)} layers, "
                         f"num_hidden_layers is {hf.num_hidden_layers}; give one type a layer")
    # HF's global RoPE is the full-attention layers'; rope_theta and rope_scaling say it.
    global_theta, global_scaling = ropes.get("full_attention", ropes[layer_types[0]])
    return ModelConfig(
        model_type=hf.model_type, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
        num_layers=hf.num_hidden_layers, num_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_key_value_heads, head_dim=hf.head_dim,
        intermediate_size=hf.intermediate_size,
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=hf.tie_word_embeddings, dtype=dtype, rms_norm_eps=hf.rms_norm_eps,
        rope_theta=global_theta, rope_scaling=global_scaling,
        attention_bias=hf.attention_bias, o_proj_bias=hf.attention_bias, qk_norm=True,
        sliding_windows=tuple(hf.sliding_window if t == "sliding_attention" else None
                              for t in layer_types),
        layer_ropes=tuple(ropes[t] for t in layer_types),
        query_pre_attn_scalar=hf.query_pre_attn_scalar,
        final_logit_softcapping=hf.final_logit_softcapping,
    )


def _deepseek_v2_config(hf, dtype: torch.dtype, source: str | Path) -> ModelConfig:
    """DeepSeek-V2 with dense MLPs only (DeepseekV2Config): multi-head latent attention, its
    sizes checked, and what the reference does not run refused by name."""
    n = hf.num_hidden_layers
    if hf.first_k_dense_replace < n:  # layers from first_k_dense_replace on are MoE in hf
        raise ValueError(f"{source}: first_k_dense_replace {hf.first_k_dense_replace} makes "
                         f"layers {hf.first_k_dense_replace}..{n - 1} mixture-of-experts "
                         "layers, which the reference model does not implement; only dense "
                         f"DeepSeek-V2 models run: first_k_dense_replace >= num_hidden_layers "
                         f"({n})")
    if hf.hidden_act not in ("silu", "swish"):
        raise ValueError(f"{source}: hidden_act {hf.hidden_act!r} is not supported; DeepSeek-V2 "
                         "uses 'silu'")
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                "q_lora_rank"):
        value = getattr(hf, key)
        if key == "q_lora_rank" and value is None:
            continue  # None: a plain q_proj
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{source}: {key} must be a positive integer (>= 1), got {value!r}"
                             + (" (or null: no query compression)" if key == "q_lora_rank"
                                else ""))
    # hf expands c_kv into num_attention_heads heads and would repeat them again for a smaller
    # num_key_value_heads: only equal counts describe a model hf runs.
    if hf.num_key_value_heads != hf.num_attention_heads:
        raise ValueError(f"{source}: num_key_value_heads {hf.num_key_value_heads} differs from "
                         f"num_attention_heads {hf.num_attention_heads}; MLA decompresses one "
                         "latent into every head's K and V, so they must be equal (as in "
                         "DeepSeek's configs)")
    rope = dict(hf.rope_parameters or {})
    theta, rope_type = rope.pop("rope_theta", 10000.0), rope.get("rope_type", "default")
    # YaRN (every published DeepSeek-V2) also scales the softmax by mscale^2 and cos/sin by
    # its attention factor: not implemented, so refused rather than computed differently.
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"{source}: rope scaling {rope_type!r} is not supported for "
                         f"DeepSeek-V2 (YaRN's mscale is not implemented); rope_type one of "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    return ModelConfig(
        model_type=hf.model_type, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
        num_layers=n, num_heads=hf.num_attention_heads, num_kv_heads=hf.num_attention_heads,
        head_dim=hf.qk_nope_head_dim + hf.qk_rope_head_dim,
        intermediate_size=hf.intermediate_size,
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=hf.tie_word_embeddings, dtype=dtype, rms_norm_eps=hf.rms_norm_eps,
        rope_theta=theta, rope_scaling=None if rope_type == "default" else rope,
        attention_bias=hf.attention_bias, o_proj_bias=hf.attention_bias,
        mlp_bias=hf.mlp_bias, sliding_windows=(None,) * n,
        kv_lora_rank=hf.kv_lora_rank, q_lora_rank=hf.q_lora_rank,
        qk_nope_head_dim=hf.qk_nope_head_dim, qk_rope_head_dim=hf.qk_rope_head_dim,
        v_head_dim=hf.v_head_dim,
    )
