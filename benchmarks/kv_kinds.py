"""What each kind of KV cache holds over a long generation: full attention, a sliding window
that gives its blocks back, a hybrid model's groups, and multi-head latent attention.

Four small random models of one shape (6 layers, hidden 64; the latent one DeepSeek-V2's
attention at that size) generate the same requests in the optimized engine. After every step
the engine's ``stats()`` says how many blocks are in use; a block's bytes are the pool's own
(``KVCacheConfig.bytes_per_block``). Each row: the peak the pool held, what the planner
(``pagedllm kv-size``) predicts the sequences hold at their full length, what every layer
keeping every token's K and V per head would cost (for MLA: the decompressed K and V its
latent stands for), and tokens per CPU second (one thread; name the CPU beside it).

    python benchmarks/kv_kinds.py [--seqs 4] [--prompt 16] [--max-tokens 496] [--window 32]
                                  [--block-size 16] [--json FILE] [--quick]
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch

from pagedllm.benchmarks.bench_report import write_json
from pagedllm.optimized import LLM
from pagedllm.reference import SamplingParams
from pagedllm.reference.kv_size import kv_size
from pagedllm.reference.model import load_config
from pagedllm.reference.model.deepseek_v2 import mla_kv_bytes_per_token
from pagedllm.reference.model.random_checkpoint import tiny_config, write_random_checkpoint

LAYERS = 6
KINDS = {  # kind: (family, layer_types or None, what its layers cache)
    "full": ("qwen3", ["full_attention"] * LAYERS, "K and V of every token, every layer"),
    "windowed": ("qwen3", ["sliding_attention"] * LAYERS, "every layer: the last W tokens"),
    "hybrid": ("qwen3", ["sliding_attention"] * 5 + ["full_attention"],
               "5 layers the last W tokens, 1 every token"),
    "latent": ("deepseek_v2", None, "one latent row a token and layer"),
}


def checkpoint(kind: str, folder: Path, window: int, max_len: int) -> Path:
    family, layer_types, _ = KINDS[kind]
    overrides = dict(num_hidden_layers=LAYERS, max_position_embeddings=max_len)
    if layer_types is not None:
        overrides.update(layer_types=layer_types, sliding_window=window,
                         use_sliding_window=True)
    return write_random_checkpoint(folder / kind, tiny_config(family, **overrides), seed=0)


def every_layer_per_token(path: Path, size) -> int:
    """Bytes a token costs where every layer keeps its K and V per head: a full-attention
    model's cache; for MLA, the decompressed K and V its latent row stands for."""
    cfg = load_config(path)
    return mla_kv_bytes_per_token(cfg, torch.float32).expanded if cfg.is_mla \
        else size.bytes_per_token


def run(kind: str, path: Path, seqs: int, prompt: int, max_tokens: int,
        block_size: int) -> dict:
    length = prompt + max_tokens
    size = kv_size(path, "float32")
    # room for every group to keep every token (the door's worst case: a recompute)
    groups = len(size.kv_cache_groups(block_size))
    llm = LLM(path, block_size=block_size, max_model_len=length,
              num_gpu_blocks=groups * seqs * -(-length // block_size))
    used: list[int] = []
    llm.engine.add_step_observer(lambda e, s, i: used.append(e.stats()["blocks_used"]))
    prompts = [{"prompt_token_ids": [(7 * j + i) % 250 for j in range(prompt)]}
               for i in range(seqs)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    cpu = time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    cpu = time.process_time() - cpu
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    per_block = llm.engine.kv_cache_config.bytes_per_block
    return {"kind": kind, "caches": KINDS[kind][2],
            "kv_cache_groups": len(llm.engine.kv_cache_config.kv_cache_groups),
            "bytes_per_block": per_block, "peak_blocks": max(used),
            "peak_bytes": max(used) * per_block,
            "planner_bytes": seqs * size.bytes_held(length, block_size),
            "every_layer_bytes": seqs * length * every_layer_per_token(path, size),
            "steps": len(used), "tokens": tokens, "tok_per_cpu_s": tokens / cpu,
            "blocks_left": llm.stats()["blocks_used"]}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", type=int, default=4)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=496)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--json", type=Path)
    p.add_argument("--quick", action="store_true", help="2 sequences of 48 tokens, blocks of 4")
    args = p.parse_args(argv)
    if args.quick:
        args.seqs, args.prompt, args.max_tokens, args.window, args.block_size = 2, 8, 40, 8, 4
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in KINDS:
            path = checkpoint(kind, Path(tmp), args.window,
                              max(64, args.prompt + args.max_tokens))
            rows.append(run(kind, path, args.seqs, args.prompt, args.max_tokens,
                            args.block_size))
    print(f"{args.seqs} sequences of {args.prompt} + {args.max_tokens} tokens, window "
          f"{args.window}, blocks of {args.block_size}, one thread; peak = the most the pool "
          "held at any step (stats()), planner = pagedllm kv-size's prediction at the end")
    print(f"{'kind':9} {'groups':>6} {'peak KiB':>9} {'planner KiB':>12} "
          f"{'every layer KiB':>16} {'peak / every layer':>19} {'tok/CPU-s':>10}  caches")
    for r in rows:
        print(f"{r['kind']:9} {r['kv_cache_groups']:>6} {r['peak_bytes'] / 1024:>9.1f} "
              f"{r['planner_bytes'] / 1024:>12.1f} {r['every_layer_bytes'] / 1024:>16.1f} "
              f"{r['peak_bytes'] / r['every_layer_bytes']:>19.2f} "
              f"{r['tok_per_cpu_s']:>10.1f}  {r['caches']}")
    write_json({"config": vars(args) | {"json": None}, "rows": rows}, args.json)
    return rows


if __name__ == "__main__":
    main()
