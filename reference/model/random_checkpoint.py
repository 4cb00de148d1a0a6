"""Small random-weight Hugging Face checkpoints of every supported family, written offline.

Tests and the demo need real checkpoint folders (config.json, model.safetensors, tokenizer
files) without downloading anything: transformers builds the model from a config with seeded
random weights and ``save_pretrained`` writes it exactly as a published checkpoint is written.
The tokenizer is byte-level (256 byte tokens and one end-of-text token), so any text encodes.
"""

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    OPTConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

EOS = "<|endoftext|>"
BYTE_VOCAB = 256 + 1  # the byte alphabet and EOS


def _byte_to_char() -> dict[int, str]:
    """GPT-2's table from each byte to the printable character ByteLevel shows it as."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE with no merges: byte b is token b, and EOS is token 256."""
    vocab = {ch: b for b, ch in _byte_to_char().items()}
    assert set(vocab) == set(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)
    assert len(fast) == BYTE_VOCAB
    return fast


def tiny_config(family: str, vocab_size: int = BYTE_VOCAB, **overrides):
    """A few-layer config of a family. Families: llama (Llama 2 style), llama3 (GQA + llama3
    rope scaling), mistral (sliding window 16), qwen2 (qkv bias, tied), qwen3 (q/k norm), opt,
    gemma3 (sliding window 16 on four of six layers, a RoPE base per layer kind, tied),
    deepseek_v2 (MLA: latent of 32 + 8 rotary, no query compression; dense MLPs only)."""
    eos = vocab_size - 1
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, eos_token_id=eos, pad_token_id=eos,
                  bos_token_id=None, tie_word_embeddings=False)
    if family == "opt":
        cfg = dict(vocab_size=vocab_size, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                   num_attention_heads=4, word_embed_proj_dim=64, max_position_embeddings=256,
                   eos_token_id=eos, pad_token_id=eos, bos_token_id=None, dropout=0.0)
        cfg.update(overrides)
        return OPTConfig(**cfg)
    families = {
        "llama": (LlamaConfig, dict(num_key_value_heads=4)),
        "llama3": (LlamaConfig, dict(rope_theta=500000.0, rope_scaling=dict(
            rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=64))),
        "mistral": (MistralConfig, dict(sliding_window=16, head_dim=16)),
        "qwen2": (Qwen2Config, dict(tie_word_embeddings=True)),
        "qwen3": (Qwen3Config, dict(head_dim=32)),  # head_dim != hidden / heads, as in Qwen3
        # Gemma 3's pattern, shortened (its checkpoints: 5 local layers, then 1 global); the
        # global RoPE linearly scaled as in the 4B-27B models; a scale that is not head_dim's.
        "gemma3": (Gemma3TextConfig, dict(
            num_hidden_layers=6, head_dim=16, sliding_window=16, query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
            rope_parameters=dict(
                sliding_attention=dict(rope_type="default", rope_theta=10_000.0),
                full_attention=dict(rope_type="linear", factor=8.0, rope_theta=1_000_000.0)),
            tie_word_embeddings=True)),
        # MLA: every layer dense (a MoE layer from first_k_dense_replace on is refused);
        # num_key_value_heads None: hf takes num_attention_heads, as MLA needs
        "deepseek_v2": (DeepseekV2Config, dict(
            num_key_value_heads=None, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=overrides.get(
                "num_hidden_layers", common["num_hidden_layers"]))),
    }
    if family not in families:
        raise ValueError(f"family {family!r} is unknown; choose one of "
                         f"{', '.join([*families, 'opt'])}")
    config_class, extra = families[family]
    return config_class(**{**common, **extra, **overrides})


def write_random_checkpoint(path: str | Path, config, seed: int = 0,
                            init_std: float = 0.02, max_shard_size: str | None = None) -> Path:
    """Save a model of `config` with seeded N(0, init_std) weights, and the byte tokenizer."""
    path = Path(path)
    config.initializer_range = init_std
    if config.model_type == "opt":
        config.init_std = init_std
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    if config.vocab_size == BYTE_VOCAB:
        byte_tokenizer().save_pretrained(path)
    return path
