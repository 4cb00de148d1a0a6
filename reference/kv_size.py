"""How many bytes the KV cache costs per token, and how many tokens fit in a GiB.

Every layer stores one key and one value vector per KV head for every token:

    bytes per token = 2 (K and V) × layers × kv_heads × head_dim × bytes per element

OPT-13B (40 layers, 40 heads of 128, fp16): 2 × 40 × 40 × 128 × 2 = 819,200 B ≈ 800 KiB per
token, so one 2048-token request holds 1,600 MiB (the paper's "1.6 GB"). Grouped-query attention
shrinks the kv_heads factor: Llama-3-8B keeps 8 KV heads for 32 query heads, 128 KiB per token.

    python -m pagedllm.reference.kv_size opt-13b llama-3-8b --tokens 2048
    python -m pagedllm.reference.kv_size path/to/checkpoint --dtype bfloat16
"""

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import load_config

GIB = 2**30


# --8<-- [start:kv_size]
@dataclass(frozen=True)
class KVSize:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    max_len: int  # the model's maximum sequence length (max_position_embeddings)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def bytes_for(self, num_tokens: int) -> int:
        return num_tokens * self.bytes_per_token

    @property
    def tokens_per_gib(self) -> int:
        return GIB // self.bytes_per_token
# --8<-- [end:kv_size]


# Published configs (config.json of each model), fp16/bf16 as served. kv_heads < heads is GQA.
PRESETS = {  # name: (layers, kv_heads, head_dim, max_len)
    "opt-6.7b": (32, 32, 128, 2048),
    "opt-13b": (40, 40, 128, 2048),
    "opt-66b": (64, 72, 128, 2048),
    "opt-175b": (96, 96, 128, 2048),
    "llama-2-7b": (32, 32, 128, 4096),
    "llama-2-13b": (40, 40, 128, 4096),
    "llama-2-70b": (80, 8, 128, 4096),
    "llama-3-8b": (32, 8, 128, 8192),
    "llama-3.1-8b": (32, 8, 128, 131072),
    "llama-3-70b": (80, 8, 128, 8192),
    "mistral-7b": (32, 8, 128, 32768),
    "qwen2.5-0.5b": (24, 2, 64, 32768),
    "qwen2.5-7b": (28, 4, 128, 32768),
    "qwen3-0.6b": (28, 8, 128, 40960),
    "qwen3-8b": (36, 8, 128, 40960),
}


def kv_size(model: str | Path, dtype: torch.dtype | str | None = None) -> KVSize:
    """KV size of a preset name (fp16 unless dtype says otherwise) or a checkpoint folder."""
    if isinstance(dtype, str):
        dtype = _parse_dtype(dtype)
    if str(model) in PRESETS:
        layers, kv_heads, head_dim, max_len = PRESETS[str(model)]
        item = torch.empty((), dtype=dtype or torch.float16).element_size()
        return KVSize(str(model), layers, kv_heads, head_dim, item, max_len)
    if not Path(model).exists():
        raise ValueError(f"{str(model)!r} is neither a preset nor a folder; presets: "
                         f"{', '.join(PRESETS)}")
    cfg = load_config(model)
    item = torch.empty((), dtype=dtype or cfg.dtype).element_size()
    return KVSize(Path(model).name, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, item,
                  cfg.max_position_embeddings)


def _parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {name!r} is not a torch dtype; try float16, bfloat16 or float32")
    return dtype


def describe(s: KVSize, tokens: int | None = None) -> str:
    tokens = tokens or s.max_len
    total = s.bytes_for(tokens)
    return "\n".join([
        f"{s.name}: 2 (K and V) x {s.num_layers} layers x {s.num_kv_heads} KV heads "
        f"x {s.head_dim} head dim x {s.dtype_bytes} bytes",
        f"  bytes per token: {s.bytes_per_token:,} ({s.bytes_per_token / 1024:,.1f} KiB)",
        f"  tokens per GiB:  {s.tokens_per_gib:,}",
        f"  {tokens:,} tokens: {total:,} bytes = {total / 2**20:,.0f} MiB "
        f"({total / GIB:.2f} GiB, {total / 1e9:.2f} GB)",
    ])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("models", nargs="+", help=f"checkpoint folders or presets: {', '.join(PRESETS)}")
    p.add_argument("--tokens", type=int, default=None,
                   help="sequence length to price (default: the model's maximum)")
    p.add_argument("--dtype", default=None, help="KV dtype (default: float16 for presets, "
                   "the checkpoint's dtype for folders)")


def run(args: argparse.Namespace) -> int:
    for model in args.models:
        print(describe(kv_size(model, args.dtype), args.tokens))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedllm.reference.kv_size",
                                     description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
