"""How many bytes the KV cache costs per token, and how many tokens fit in a GiB.

Every layer stores one key and one value vector per KV head for every token:

    bytes per token = 2 (K and V) × layers × kv_heads × head_dim × bytes per element

A quantized cache (``--kv-cache-dtype``, ``ops/kv_quant.py``) stores fewer bytes per element and,
for int8 / int4, a 2-byte scale per token and KV head, which the count includes:
head_dim × bytes per element becomes 64 + 2 bytes (int8) or 32 + 2 (int4) for head_dim 64.

OPT-13B (40 layers, 40 heads of 128, fp16): 2 × 40 × 40 × 128 × 2 = 819,200 B ≈ 800 KiB per
token, so one 2048-token request holds 1,600 MiB (the paper's "1.6 GB"). Grouped-query attention
shrinks the kv_heads factor: Llama-3-8B keeps 8 KV heads for 32 query heads, 128 KiB per token.

A sliding-window model (every layer reads the last W tokens, as Mistral-7B-v0.1's 4,096) gives
back the blocks that fall out of the window, so a decoding sequence holds at most
ceil(W / block_size) + 1 blocks, however long it is: Mistral-7B-v0.1 at 32,768 tokens costs
the 257 blocks of 16 (4,112 tokens) of its window, not 2,048 blocks. A model that mixes
windowed and full layers (Gemma 3) is priced as the engine lays it out: its layers in KV cache
groups (``kv/kv_cache_spec.py``'s ``group_layers``), a windowed group holding at most its
window's blocks, a full group every block.

The same arithmetic plans capacity. In a KV budget of M bytes, a contiguous cache that reserves
the full context L for every sequence fits M / (L x bytes per token) sequences, however short
they turn out; a paged cache holds only the tokens a sequence has (rounded up to whole blocks),
so it fits as many as their actual lengths allow. Turned around (seed 004's example): to serve
160 users at once from one GPU, each can be given only M / 160 bytes of context.

    python -m pagedllm.reference.kv_size opt-13b llama-3-8b --tokens 2048
    python -m pagedllm.reference.kv_size path/to/checkpoint --dtype bfloat16
    python -m pagedllm.reference.kv_size llama-2-7b --memory-gib 60 --context 4096 --users 160
"""

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from .kv.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    group_layers,
)
from .model.config import load_config
from .ops.kv_quant import kv_cache_format

GIB = 2**30
# A budget above this is a typo (bytes or MiB given as GiB), not a GPU: 1e6 GiB is a petabyte.
MAX_MEMORY_GIB = 1e6


# --8<-- [start:kv_size]
@dataclass(frozen=True)
class KVSize:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    max_len: int  # the model's maximum sequence length
    kv_cache_dtype: str = "auto"  # auto: dtype_bytes each; else ops/kv_quant.py
    # per layer, the window it attends to (None: all tokens); () if none slides
    layer_windows: tuple[int | None, ...] = ()
    # MLA: one latent row of head_dim numbers a token and layer, no V
    latent: bool = False

    @property
    def bytes_per_token_head(self) -> int:
        """One token's K (or V) for one KV head, its scale included."""
        fmt = kv_cache_format(self.kv_cache_dtype)
        return fmt.bytes_per_token_head(self.head_dim, self.dtype_bytes)

    @property
    def bytes_per_token(self) -> int:
        """Every layer's K and V of one token: what a token costs where every
        layer keeps it (full attention, or a contiguous slab)."""
        heads = self.num_layers * self.num_kv_heads
        return (1 if self.latent else 2) * heads * self.bytes_per_token_head

    def bytes_for(self, num_tokens: int) -> int:
        return num_tokens * self.bytes_per_token

    @property
    def tokens_per_gib(self) -> int:
        return GIB // self.bytes_per_token
# --8<-- [end:kv_size]

    @property
    def sliding_window(self) -> int | None:
        """The window, where every layer slides over the same one (Mistral); else None."""
        windows = set(self.layer_windows)
        return windows.pop() if len(windows) == 1 and None not in windows else None

    def kv_cache_groups(self, block_size: int = 16) -> tuple[KVCacheGroupSpec, ...]:
        """The layers grouped as the engine's runner groups them (``group_layers``)."""
        dtype = {2: torch.float16, 4: torch.float32, 8: torch.float64}[self.dtype_bytes]
        shape = (block_size, self.num_kv_heads, self.head_dim, dtype, self.kv_cache_dtype)
        if self.latent:
            return group_layers([MLAAttentionSpec(*shape)] * self.num_layers)
        windows = self.layer_windows or (None,) * self.num_layers
        return group_layers([FullAttentionSpec(*shape) if w is None
                             else SlidingWindowSpec(*shape, sliding_window=w) for w in windows])

    def bytes_per_block(self, block_size: int = 16) -> int:
        """What one block id costs the pool: a row in each tensor its group's layers share
        (one group: every layer's K and V for block_size tokens)."""
        return KVCacheConfig(1, 0, self.kv_cache_groups(block_size)).bytes_per_block

    # --8<-- [start:held_tokens]
    def held_blocks(self, num_tokens: int, block_size: int = 16) -> int:
        """Blocks a decoding sequence of num_tokens tokens holds in its KV cache
        groups: a full group all of them, a windowed group at most
        ceil(W / block_size) + 1 (the window at any offset in its blocks; those
        before it went back to the pool)."""
        groups = self.kv_cache_groups(block_size)
        return sum(g.kv_cache_spec.max_blocks_per_seq(num_tokens) for g in groups)
    # --8<-- [end:held_tokens]

    def bytes_held(self, num_tokens: int, block_size: int = 16) -> int:
        """The pool's bytes a decoding sequence of num_tokens tokens holds."""
        return self.held_blocks(num_tokens, block_size) * self.bytes_per_block(block_size)


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
    "llama-3.1-405b": (126, 8, 128, 131072),  # seed 003's 400B-class model
    "mistral-7b": (32, 8, 128, 32768),  # v0.1: sliding window 4096 (SLIDING_WINDOWS)
    "qwen2.5-0.5b": (24, 2, 64, 32768),
    "qwen2.5-7b": (28, 4, 128, 32768),
    "qwen3-0.6b": (28, 8, 128, 40960),
    "qwen3-8b": (36, 8, 128, 40960),
    "smollm2-135m-instruct": (30, 3, 64, 8192),  # the real model pagedllm runs (registry.py)
    "gemma-3-1b": (26, 1, 256, 32768),  # 5 local layers (window 512) to 1 global
    "gemma-3-27b": (62, 16, 128, 131072),  # 5 local layers (window 1024) to 1 global
}


# Presets whose every layer attends to a sliding window (config.json's sliding_window).
SLIDING_WINDOWS = {"mistral-7b": 4096}
# Presets that mix kinds: (window, n) — every n-th layer is global, the others slide (Gemma 3's
# sliding_window_pattern: layer i is global where (i + 1) % n == 0).
LAYER_PATTERNS = {"gemma-3-1b": (512, 6), "gemma-3-27b": (1024, 6)}


# Latent-attention (MLA) models: (layers, kv_lora_rank, qk_rope_head_dim, max_len, query heads,
# qk_nope_head_dim, v_head_dim). A token and layer cache kv_lora_rank + qk_rope_head_dim numbers.
LATENT_PRESETS = {"deepseek-v2": (60, 512, 64, 163840, 128, 128, 128),
                  "deepseek-v3": (61, 512, 64, 163840, 128, 128, 128)}


# --8<-- [start:attention_variants]
def attention_variants(name: str, dtype_bytes: int = 2,
                       gqa_kv_heads: int = 8) -> list[tuple[str, str, int]]:
    """Bytes a token costs a latent preset's layers under each attention kind: (kind, what
    each layer caches, bytes per token). MHA, GQA and MQA cache K and V for 128, 8 and 1 K/V
    heads of the query heads' size; MLA one latent row (DeepSeek-V2's paper, Table 1)."""
    layers, rank, rope, _, heads, nope, _ = LATENT_PRESETS[name]
    head_dim = nope  # the size a head would have without the latent (128)

    def kv(kv_heads: int) -> int:
        return 2 * layers * kv_heads * head_dim * dtype_bytes

    return [("MHA", f"K and V, {heads} heads of {head_dim}", kv(heads)),
            ("GQA", f"K and V, {gqa_kv_heads} heads of {head_dim}", kv(gqa_kv_heads)),
            ("MQA", f"K and V, 1 head of {head_dim}", kv(1)),
            ("MLA", f"a latent of {rank} + a rotary key of {rope}",
             layers * (rank + rope) * dtype_bytes)]
# --8<-- [end:attention_variants]


def _preset_windows(name: str, num_layers: int) -> tuple[int | None, ...]:
    if name in SLIDING_WINDOWS:
        return (SLIDING_WINDOWS[name],) * num_layers
    if name in LAYER_PATTERNS:
        window, n = LAYER_PATTERNS[name]
        return tuple(None if (i + 1) % n == 0 else window for i in range(num_layers))
    return ()


def kv_size(model: str | Path, dtype: torch.dtype | str | None = None,
            kv_cache_dtype: str = "auto") -> KVSize:
    """KV size of a preset name (fp16 unless dtype says otherwise) or a checkpoint folder, with
    the cache stored as kv_cache_dtype (auto: in dtype)."""
    kv_cache_dtype = kv_cache_format(kv_cache_dtype).name  # unknown names: ValueError
    if not isinstance(model, str | Path):
        raise TypeError(f"model must be a preset name or a checkpoint folder (str or Path), got "
                        f"{model!r} ({type(model).__name__})")
    if isinstance(dtype, str):
        dtype = _parse_dtype(dtype)
    elif dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a name such as 'float16' or a torch.dtype, got "
                        f"{dtype!r} ({type(dtype).__name__})")
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype {dtype} is not a floating dtype; the KV cache holds keys and "
                         "values as float16, bfloat16 or float32")
    if str(model) in PRESETS:
        layers, kv_heads, head_dim, max_len = PRESETS[str(model)]
        item = torch.empty((), dtype=dtype or torch.float16).element_size()
        return KVSize(str(model), layers, kv_heads, head_dim, item, max_len, kv_cache_dtype,
                      _preset_windows(str(model), layers))
    if str(model) in LATENT_PRESETS:
        layers, rank, rope, max_len = LATENT_PRESETS[str(model)][:4]
        item = torch.empty((), dtype=dtype or torch.bfloat16).element_size()
        return KVSize(str(model), layers, 1, rank + rope, item, max_len, kv_cache_dtype,
                      latent=True)
    if str(model) == "" or not Path(model).exists():
        raise ValueError(f"{str(model)!r} is neither a preset nor a folder; presets: "
                         f"{', '.join([*PRESETS, *LATENT_PRESETS])}")
    cfg = load_config(model)
    item = torch.empty((), dtype=dtype or cfg.dtype).element_size()
    if cfg.is_mla:  # one latent row a token and layer
        return KVSize(Path(model).name, cfg.num_layers, 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                      item, cfg.max_position_embeddings, kv_cache_dtype, latent=True)
    windows = cfg.sliding_windows if any(w is not None for w in cfg.sliding_windows) else ()
    return KVSize(Path(model).name, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, item,
                  cfg.max_position_embeddings, kv_cache_dtype, tuple(windows))


def _parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {name!r} is not a torch dtype; try float16, bfloat16 or float32")
    return dtype


def describe(s: KVSize, tokens: int | None = None, block_size: int = 16) -> str:
    if tokens is None:
        tokens = s.max_len
    _check_positive(tokens=tokens)  # 0 must not quietly become "the maximum"
    total = s.bytes_for(tokens)
    if s.kv_cache_dtype == "auto":
        per_head = f"{s.head_dim} head dim x {s.dtype_bytes} bytes"
    else:
        per_head = f"{s.bytes_per_token_head} bytes per head ({s.kv_cache_dtype}, scales included)"
    what = (f"{s.num_layers} layers x one latent row of {s.head_dim} x {s.dtype_bytes} bytes"
            if s.latent else
            f"2 (K and V) x {s.num_layers} layers x {s.num_kv_heads} KV heads x {per_head}")
    lines = [
        f"{s.name}: {what}",
        f"  bytes per token: {s.bytes_per_token:,} ({s.bytes_per_token / 1024:,.1f} KiB)",
        f"  tokens per GiB:  {s.tokens_per_gib:,}",
        f"  {tokens:,} tokens: {total:,} bytes = {total / 2**20:,.0f} MiB "
        f"({total / GIB:.2f} GiB, {total / 1e9:.2f} GB)",
    ]
    if s.sliding_window is not None:
        held = s.held_blocks(tokens, block_size)
        held_bytes = s.bytes_held(tokens, block_size)
        lines.append(f"  sliding window {s.sliding_window:,}: a sequence holds at most {held:,} "
                     f"blocks of {block_size} = {held_bytes:,} bytes = "
                     f"{held_bytes / 2**20:,.0f} MiB, however long")
    if s.name in LATENT_PRESETS:  # what the latent saves, kind by kind
        rows = attention_variants(s.name, s.dtype_bytes)
        mla = rows[-1][2]
        lines.append(f"  the same {s.num_layers} layers under each kind of attention:")
        lines += [f"    {kind}  {what:42} {cost:>10,} B per token  {cost / mla:5.2f}x MLA"
                  for kind, what, cost in rows]
    elif s.layer_windows and s.sliding_window is None:  # windowed and full layers
        groups = s.kv_cache_groups(block_size)
        local = sum(isinstance(g.kv_cache_spec, SlidingWindowSpec) for g in groups)
        held_bytes = s.bytes_held(tokens, block_size)
        lines.append(f"  {len(groups)} KV cache groups of {len(groups[0].layer_ids)} layers "
                     f"({local} windowed, {len(groups) - local} full): {tokens:,} tokens hold "
                     f"{s.held_blocks(tokens, block_size):,} blocks of {block_size} = "
                     f"{held_bytes:,} bytes = {held_bytes / 2**20:,.0f} MiB "
                     f"({held_bytes / total:.0%} of every layer's)")
    return "\n".join(lines)


# --8<-- [start:capacity]
def contiguous_capacity(s: KVSize, memory_bytes: int, context: int) -> int:
    """Sequences that fit when each reserves a slab for its full context, up front."""
    _check_positive(memory_bytes=memory_bytes, context=context)
    return memory_bytes // s.bytes_for(context)


def paged_capacity(s: KVSize, memory_bytes: int, mean_tokens: int,
                   block_size: int = 16) -> int:
    """Sequences of mean_tokens actual tokens each that fit in block_size-slot blocks.

    A paged sequence holds ceil(tokens / block_size) blocks and reserves nothing ahead,
    so the answer depends on how long sequences really are, not on how long they are
    allowed to be.
    """
    _check_positive(memory_bytes=memory_bytes, mean_tokens=mean_tokens,
                    block_size=block_size)
    num_blocks = memory_bytes // s.bytes_per_block(block_size)
    # a window: at most its own blocks
    return num_blocks // s.held_blocks(mean_tokens, block_size)


def context_per_user(s: KVSize, memory_bytes: int, users: int) -> int:
    """The longest context each of `users` concurrent sequences can be guaranteed."""
    _check_positive(memory_bytes=memory_bytes, users=users)
    return memory_bytes // (users * s.bytes_per_token)
# --8<-- [end:capacity]


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def _check_memory_gib(name: str, value: float) -> None:
    """A KV budget in GiB: a finite number above zero, and not absurdly large."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number of GiB, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number of GiB, got {value}; give the GPU "
                         "memory left for the KV cache, e.g. 60")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}; give the GPU memory left for the "
                         "KV cache in GiB, e.g. 60")
    if value > MAX_MEMORY_GIB:
        raise ValueError(f"{name} must be at most {MAX_MEMORY_GIB:g} GiB (a petabyte), got "
                         f"{value:g}; it is in GiB, not bytes or MiB: e.g. 60")


def plan(s: KVSize, memory_gib: float, context: int | None = None, mean_tokens: int | None = None,
         block_size: int = 16, users: int | None = None) -> str:
    """The capacity questions for one model and KV budget, answered in words."""
    _check_memory_gib("memory_gib", memory_gib)
    memory = int(memory_gib * GIB)
    context = s.max_len if context is None else context
    _check_positive(context=context)
    if context > s.max_len:
        raise ValueError(f"context {context} exceeds {s.name}'s maximum length of {s.max_len}")
    mean_tokens = max(context // 2, 1) if mean_tokens is None else mean_tokens
    if mean_tokens > context:
        raise ValueError(f"mean_tokens {mean_tokens} exceeds the context of {context}")
    slots = memory // s.bytes_per_token
    contiguous = contiguous_capacity(s, memory, context)
    paged = paged_capacity(s, memory, mean_tokens, block_size)
    lines = [
        f"  KV budget {memory_gib:g} GiB = {slots:,} token slots",
        f"  contiguous, each reserves {context:,} tokens: {contiguous:,} sequences",
        f"  paged (blocks of {block_size}), sequences of {mean_tokens:,} tokens on average: "
        f"{paged:,} sequences" + (f" ({paged / contiguous:.1f}x)" if contiguous else ""),
    ]
    if users is not None:
        each = context_per_user(s, memory, users)
        lines.append(f"  {users:,} users at once: at most {each:,} tokens of context each"
                     + (f" (not even one token: {users:,} users need "
                        f"{users * s.bytes_per_token / GIB:.2f} GiB per token of context)"
                        if each == 0 else ""))
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("models", nargs="+", help=f"checkpoint folders or presets: {', '.join(PRESETS)}")
    p.add_argument("--tokens", type=int, default=None,
                   help="sequence length to price (default: the model's maximum)")
    p.add_argument("--dtype", default=None, help="KV dtype (default: float16 for presets, "
                   "the checkpoint's dtype for folders)")
    p.add_argument("--kv-cache-dtype", default="auto", help="store the cache quantized: auto "
                   "(in --dtype), fp8 (= fp8_e4m3), fp8_e5m2, int8 or int4 (scales included)")
    plan_args = p.add_argument_group("capacity planning (needs --memory-gib)")
    plan_args.add_argument("--memory-gib", type=float, default=None,
                           help="GPU memory left for the KV cache, in GiB")
    plan_args.add_argument("--context", type=int, default=None,
                           help="context each sequence may reach (default: the model's maximum)")
    plan_args.add_argument("--mean-tokens", type=int, default=None,
                           help="tokens a sequence actually holds on average (default: half "
                           "the context)")
    plan_args.add_argument("--block-size", type=int, default=16, help="paged block size (tokens)")
    plan_args.add_argument("--users", type=int, default=None,
                           help="concurrent users: how much context can each have?")
    gpu = p.add_argument_group("weights and KV per GPU (reference/deployment.py; needs "
                               "--gpu-memory-gib)")
    gpu.add_argument("--gpu-memory-gib", type=float, default=None,
                     help="memory of each GPU, in GiB (e.g. 80 for an A100-80GB)")
    gpu.add_argument("--tensor-parallel-size", type=int, default=1,
                     help="GPUs the model is split across (default 1)")
    gpu.add_argument("--quantization", default=None, choices=["fp8", "int8", "int4"],
                     help="weight scheme (default: weights in --dtype)")
    gpu.add_argument("--quantization-group-size", type=int, default=32,
                     help="int4 group size (default 32)")
    gpu.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                     help="fraction of each GPU the engine may use (vLLM's default 0.9)")


def run(args: argparse.Namespace) -> int:
    planning = getattr(args, "memory_gib", None)
    gpu_memory = getattr(args, "gpu_memory_gib", None)
    if planning is None and any(getattr(args, name, None) is not None
                                for name in ("mean_tokens", "users")):
        raise ValueError("--mean-tokens and --users plan capacity: give the KV budget with "
                         "--memory-gib too")
    if planning is None and gpu_memory is None and getattr(args, "context", None) is not None:
        raise ValueError("--context plans capacity: give the KV budget with --memory-gib or "
                         "each GPU's memory with --gpu-memory-gib too")
    if planning is not None:
        _check_memory_gib("--memory-gib", planning)
    if gpu_memory is None and (getattr(args, "quantization", None) is not None
                               or getattr(args, "tensor_parallel_size", 1) != 1):
        raise ValueError("--quantization and --tensor-parallel-size plan weights per GPU: give "
                         "each GPU's memory with --gpu-memory-gib too")
    if args.tokens is not None and args.tokens < 1:
        raise ValueError(f"--tokens must be >= 1, got {args.tokens}; leave it out to price "
                         "the model's maximum length")
    for model in args.models:
        s = kv_size(model, args.dtype, getattr(args, "kv_cache_dtype", "auto"))
        text = describe(s, args.tokens, getattr(args, "block_size", 16))
        if planning is not None:  # computed before printing: bad input prints nothing
            text += "\n" + plan(s, planning, args.context, args.mean_tokens, args.block_size,
                                args.users)
        if gpu_memory is not None:
            from .deployment import deployment, describe_deployment  # it builds on KVSize

            d = deployment(s, gpu_memory, args.tensor_parallel_size, args.quantization,
                           args.quantization_group_size, args.gpu_memory_utilization)
            context = s.max_len if args.context is None else args.context
            text += "\n" + describe_deployment(d, context)
        print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedllm.reference.kv_size",
                                     description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except (ValueError, TypeError, OSError) as err:  # bad input: what was wrong, no traceback
        print("error: " + " ".join(str(err).split()), file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
