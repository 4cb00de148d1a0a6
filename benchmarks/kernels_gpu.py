"""The Triton kernels on one GPU, side by side with what torch offers, in one run.

(a) Paged decode attention, a batch of 64 decodes at contexts 512 .. 8192 (32 query / 8 K/V
    heads, head_dim 128, bf16, blocks of 16 tokens): achieved bandwidth, that is the bytes the
    kernel must move (the K/V of every context position, q and out) over its median time. Beside
    it a device-to-device copy of a large buffer measured in the same run (bytes read + written:
    what the memory system gives) and torch's ``scaled_dot_product_attention`` on the same
    K/V laid out contiguously ([B, kv_heads, context, head_dim], GQA by ``enable_gqa``), the
    dense layout a paged cache gives up. Goal: >= 80 % of the copy at context 4096.
(b) Prefill attention (causal, whole prompts of 512 .. 8192 tokens, about 16k tokens per batch):
    TFLOP/s, counting 4 * heads * head_dim * L^2 / 2 per prompt for both, against SDPA's
    FlashAttention backend (``sdpa_kernel(SDPBackend.FLASH_ATTENTION)``, K/V repeated to the
    query heads outside the timing). Goal: >= 80 % of flash at 4096.
(d) Decode attention over a quantized KV cache (``kv_cache_dtype`` fp8_e4m3, fp8_e5m2, int8,
    int4 against auto = bf16), contexts 4096 and 32768: the kernel reads fewer bytes per key and
    dequantizes each tile in registers. The number is "bf16-equivalent" bandwidth, the bytes a
    bf16 cache of the same context holds over the median time, so the ratio to auto's row is the
    speed-up (long contexts are bound by reading the cache and should gain most).
(c) The fused small ops (``pagedllm.kernels``: rms_norm with residual, rotary, silu_and_mul,
    store_kv) against their torch twins (``pagedllm.reference.ops``), in GB/s of the bytes each
    must read and write. Imported lazily: a kernel not written yet shows as "not built".

Times are medians of ``triton.testing.do_bench``. About a minute on an H200; installs nothing:

    PYTHONPATH=. python benchmarks/kernels_gpu.py --json /tmp/kernels_gpu.json
    python benchmarks/kernels_gpu.py --dry-run     # no GPU: tiny sizes, every path run once

``--dry-run`` builds every input at tiny sizes on the CPU and runs every path once (the kernels
through Triton's interpreter, TRITON_INTERPRET=1; SDPA and the copy in torch), with no timing:
a check that the script works, its numbers are blank. Exit status 1 if any path failed (the
table says which); 0 otherwise.
"""

import argparse
import importlib
import json
import math
import os
import platform
import sys
import traceback

import torch

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
DECODE_BATCH = 64
CONTEXTS = (512, 1024, 2048, 4096, 8192)
PREFILL_TOKENS = 16384  # tokens per prefill batch: 32 prompts of 512, ..., 2 of 8192
GOAL_DECODE, GOAL_PREFILL = 0.8, 0.8
HEADER = "section   case                      ours            baseline        ratio   goal"


class Bench:
    """Timing (or, in a dry run, one call) of each path; failures are recorded, not raised."""

    def __init__(self, dry_run: bool):
        self.dry_run = dry_run
        self.device = "cpu" if dry_run else "cuda"
        self.failures: list[str] = []

    def time_ms(self, fn) -> float:
        if self.dry_run:
            fn()
            return float("nan")
        import triton.testing
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    def guarded(self, what: str, fn):
        try:
            return fn()
        except Exception as exc:  # the table says which path failed; the exit status too
            traceback.print_exc()
            self.failures.append(f"{what}: {type(exc).__name__}: {exc}")
            return None


# -- (a) decode ------------------------------------------------------------------------------------
def paged_cache(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, block: int,
                dtype, device, gen):
    """A full paged cache for `batch` sequences of `context` tokens in shuffled blocks, and the
    same K/V contiguous [batch, kv_heads, context, head_dim] for SDPA."""
    blocks_per_seq = -(-context // block)
    num_blocks = batch * blocks_per_seq
    k = torch.randn(batch, kv_heads, context, head_dim, generator=gen, device=device).to(dtype)
    v = torch.randn(batch, kv_heads, context, head_dim, generator=gen, device=device).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen, device=device)
    block_tables = perm.view(batch, blocks_per_seq).int()
    k_cache = torch.zeros(num_blocks, block, kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    pad = blocks_per_seq * block - context
    for cache, dense in ((k_cache, k), (v_cache, v)):
        tokens = torch.nn.functional.pad(dense.transpose(1, 2), (0, 0, 0, 0, 0, pad))
        cache[block_tables.long().flatten()] = tokens.reshape(num_blocks, block, kv_heads,
                                                              head_dim)
    return k, v, k_cache, v_cache, block_tables


def bench_decode(bench: Bench, sizes: dict, rows: list):
    from pagedllm.kernels.paged_attention import paged_attention
    dev, dtype = bench.device, sizes["dtype"]
    batch, heads, kv_heads, head_dim = (sizes["decode_batch"], sizes["heads"], sizes["kv_heads"],
                                        sizes["head_dim"])
    el = torch.finfo(dtype).bits // 8
    # the memory system's own number: a large device-to-device copy (read + write)
    src = torch.empty(sizes["copy_bytes"] // 4, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    ms = bench.time_ms(lambda: dst.copy_(src))
    copy_gbs = 2 * src.numel() * 4 / ms / 1e6
    size = src.numel() * 4
    label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
    rows.append(dict(section="decode", case=f"copy {label}", ours=copy_gbs,
                     baseline=None, unit="GB/s", goal=None))
    gen = torch.Generator(device=dev).manual_seed(0)
    scale = head_dim ** -0.5
    for context in sizes["contexts"]:
        def run(context=context):
            k, v, k_cache, v_cache, tables = paged_cache(batch, context, heads, kv_heads,
                                                         head_dim, sizes["block"], dtype, dev, gen)
            q = torch.randn(batch, heads, head_dim, generator=gen, device=dev).to(dtype)
            seq_lens = torch.full((batch,), context, dtype=torch.int32)
            starts = torch.arange(batch + 1, dtype=torch.int32)
            ours = bench.time_ms(lambda: paged_attention(q, k_cache, v_cache, tables,
                                                         seq_lens, starts, scale))
            q4 = q.view(batch, heads, 1, head_dim)
            sdpa = bench.time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
                q4, k, v, scale=scale, enable_gqa=True))
            if bench.dry_run:  # both paths compute the same attention: the inputs are right
                got = paged_attention(q, k_cache, v_cache, tables, seq_lens, starts, scale)
                want = torch.nn.functional.scaled_dot_product_attention(
                    q4, k, v, scale=scale, enable_gqa=True).view_as(got)
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            moved = 2 * batch * context * kv_heads * head_dim * el + 2 * q.numel() * el
            ours_gbs, sdpa_gbs = moved / ours / 1e6, moved / sdpa / 1e6
            rows.append(dict(section="decode", case=f"ctx {context} vs copy", ours=ours_gbs,
                             baseline=copy_gbs, unit="GB/s",
                             goal=GOAL_DECODE if context == 4096 else None, ms=ours))
            rows.append(dict(section="decode", case=f"ctx {context} vs SDPA dense", ours=ours_gbs,
                             baseline=sdpa_gbs, unit="GB/s", goal=None, ms=sdpa))
        bench.guarded(f"decode context {context}", run)


# -- (d) decode over a quantized cache ----------------------------------------------------------
def bench_kv_dtypes(bench: Bench, sizes: dict, rows: list):
    from pagedllm.kernels.paged_attention import paged_attention
    from pagedllm.reference.ops import kv_cache_format, store_kv
    dev, dtype = bench.device, sizes["dtype"]
    heads, kv_heads, head_dim, block = (sizes["heads"], sizes["kv_heads"], sizes["head_dim"],
                                        sizes["block"])
    el = torch.finfo(dtype).bits // 8
    gen = torch.Generator(device=dev).manual_seed(1)
    scale = head_dim ** -0.5
    for context, batch in sizes["quant_contexts"]:
        def run(context=context, batch=batch):
            _, _, k_cache, v_cache, tables = paged_cache(batch, context, heads, kv_heads,
                                                         head_dim, block, dtype, dev, gen)
            q = torch.randn(batch, heads, head_dim, generator=gen, device=dev).to(dtype)
            seq_lens = torch.full((batch,), context, dtype=torch.int32)
            starts = torch.arange(batch + 1, dtype=torch.int32)
            moved = 2 * batch * context * kv_heads * head_dim * el  # what a bf16 cache holds
            slots = torch.arange(k_cache.shape[0] * block, device=dev)
            auto_ms = None
            for name in ("auto", "fp8_e4m3", "fp8_e5m2", "int8", "int4"):
                fmt = kv_cache_format(name)
                if fmt.scales == "none":
                    caches, quant = (k_cache, v_cache), ("auto", None, None)
                else:
                    shape = (*k_cache.shape[:3], fmt.storage_head_dim(head_dim))
                    caches = tuple(torch.empty(shape, dtype=fmt.storage_dtype, device=dev)
                                   for _ in range(2))
                    if fmt.scales == "per_tensor":
                        scales = (torch.full((1,), 0.05, device=dev),) * 2
                    else:
                        shape = (*k_cache.shape[:3], *((2,) if fmt.zero_point else ()))
                        scales = tuple(torch.empty(shape, dtype=fmt.scale_dtype, device=dev)
                                       for _ in range(2))
                    flat = [c.view(-1, kv_heads, head_dim) for c in (k_cache, v_cache)]
                    store_kv(*flat, *caches, slots, name, *scales)  # the twin quantizes
                    quant = (name, *scales)
                ms = bench.time_ms(lambda caches=caches, quant=quant: paged_attention(
                    q, *caches, tables, seq_lens, starts, scale, None, *quant))
                auto_ms = ms if name == "auto" else auto_ms
                rows.append(dict(section="kv dtype", case=f"ctx {context} {name}",
                                 ours=moved / ms / 1e6, baseline=moved / auto_ms / 1e6,
                                 unit="GB/s", goal=None, ms=ms))
        bench.guarded(f"kv dtypes context {context}", run)


# -- (b) prefill -----------------------------------------------------------------------------------
def bench_prefill(bench: Bench, sizes: dict, rows: list):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from pagedllm.kernels.paged_attention import paged_attention
    dev, dtype = bench.device, sizes["dtype"]
    heads, kv_heads, head_dim = sizes["heads"], sizes["kv_heads"], sizes["head_dim"]
    gen = torch.Generator(device=dev).manual_seed(1)
    scale = head_dim ** -0.5
    for length in sizes["prompts"]:
        def run(length=length):
            batch = max(1, sizes["prefill_tokens"] // length)
            k, v, k_cache, v_cache, tables = paged_cache(batch, length, heads, kv_heads,
                                                         head_dim, sizes["block"], dtype, dev, gen)
            q = torch.randn(batch, heads, length, head_dim, generator=gen, device=dev).to(dtype)
            q_flat = q.transpose(1, 2).reshape(batch * length, heads, head_dim).contiguous()
            seq_lens = torch.full((batch,), length, dtype=torch.int32)
            starts = torch.arange(batch + 1, dtype=torch.int32) * length
            ours = bench.time_ms(lambda: paged_attention(q_flat, k_cache, v_cache, tables,
                                                         seq_lens, starts, scale))
            group = heads // kv_heads
            k_rep, v_rep = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            backend = SDPBackend.MATH if bench.dry_run else SDPBackend.FLASH_ATTENTION
            with sdpa_kernel(backend):  # the dry run's CPU has no flash kernel
                flash = bench.time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
                    q, k_rep, v_rep, scale=scale, is_causal=True))
            if bench.dry_run:
                got = paged_attention(q_flat, k_cache, v_cache, tables, seq_lens, starts,
                                      scale)
                want = torch.nn.functional.scaled_dot_product_attention(
                    q, k_rep, v_rep, scale=scale, is_causal=True).transpose(1, 2).reshape_as(got)
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            flops = 4 * batch * heads * head_dim * length * length / 2
            rows.append(dict(section="prefill", case=f"{batch} x {length} vs flash",
                             ours=flops / ours / 1e9, baseline=flops / flash / 1e9,
                             unit="TFLOP/s", goal=GOAL_PREFILL if length == 4096 else None,
                             ms=ours))
        bench.guarded(f"prefill length {length}", run)


# -- (c) fused small ops ---------------------------------------------------------------------------
def bench_small_ops(bench: Bench, sizes: dict, rows: list):
    from pagedllm.reference import ops as twins
    dev, dtype = bench.device, sizes["dtype"]
    tokens, hidden, inter = sizes["tokens"], sizes["hidden"], sizes["intermediate"]
    heads, kv_heads, head_dim = sizes["heads"], sizes["kv_heads"], sizes["head_dim"]
    el = torch.finfo(dtype).bits // 8
    gen = torch.Generator(device=dev).manual_seed(2)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=dev).to(dtype)

    x, residual, weight = randn(tokens, hidden), randn(tokens, hidden), randn(hidden)
    q, k = randn(tokens, heads, head_dim), randn(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 8192, (tokens,), generator=gen, device=dev)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=dev).float() / head_dim))
    gate_up = randn(tokens, 2 * inter)
    num_blocks = -(-tokens // sizes["block"]) * 2
    k_cache = torch.zeros(num_blocks, sizes["block"], kv_heads, head_dim, dtype=dtype, device=dev)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(num_blocks * sizes["block"], generator=gen, device=dev)[:tokens]
    v = randn(tokens, kv_heads, head_dim)
    cases = {  # module: (call with a given function, bytes read + written)
        "rms_norm": (lambda f: f(x, weight, 1e-6, residual), (4 * x.numel() + hidden) * el),
        "rotary": (lambda f: f(q, k, positions, inv_freq),
                   2 * (q.numel() + k.numel()) * el + positions.numel() * 8),
        "silu_and_mul": (lambda f: f(gate_up), 3 * tokens * inter * el),
        "store_kv": (lambda f: f(k, v, k_cache, v_cache, slots),
                     4 * k.numel() * el + slots.numel() * 8),
    }
    for name, (call, moved) in cases.items():
        try:
            kernel = getattr(importlib.import_module(f"pagedllm.kernels.{name}"), name)
        except ImportError as exc:
            rows.append(dict(section="small op", case=f"{name}: not built ({exc.name})",
                             ours=None, baseline=None, unit="GB/s", goal=None))
            continue

        def run(name=name, call=call, moved=moved, kernel=kernel):
            ours = bench.time_ms(lambda: call(kernel))
            twin = bench.time_ms(lambda: call(getattr(twins, name)))
            rows.append(dict(section="small op", case=f"{name} vs torch", ours=moved / ours / 1e6,
                             baseline=moved / twin / 1e6, unit="GB/s", goal=None, ms=ours))
        bench.guarded(f"small op {name}", run)


# -- report ----------------------------------------------------------------------------------------
def fmt(value, unit):
    if value is None:
        return "-".ljust(15)
    if isinstance(value, float) and math.isnan(value):
        return "(dry run)".ljust(15)
    return f"{value:8.1f} {unit}".ljust(15)


def print_table(rows: list):
    print(HEADER)
    print("-" * len(HEADER))
    for r in rows:
        ratio = (r["ours"] / r["baseline"] if r["ours"] and r["baseline"]
                 and not math.isnan(r["ours"]) else None)
        ratio_s = f"{ratio:6.2f}" if ratio is not None else "     -"
        goal = ""
        if r["goal"] is not None:
            verdict = "" if ratio is None else ("  met" if ratio >= r["goal"] else "  MISSED")
            goal = f">= {r['goal']:.2f}{verdict}"
        print(f"{r['section']:<9} {r['case']:<25} {fmt(r['ours'], r['unit'])} "
              f"{fmt(r['baseline'], r['unit'])} {ratio_s}   {goal}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny sizes on the CPU, kernels interpreted, no timing")
    parser.add_argument("--sections", default="abcd", help="which of a, b, c, d to run")
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # read by kernels/runtime.py at every launch
        sizes = dict(dtype=torch.float32, heads=4, kv_heads=2, head_dim=32, block=8,
                     decode_batch=2, contexts=(21, 40), copy_bytes=1 << 16, prompts=(13, 32),
                     prefill_tokens=32, tokens=8, hidden=64, intermediate=64,
                     quant_contexts=((21, 2), (40, 1)))
    else:
        if not torch.cuda.is_available():
            print("needs a CUDA GPU (or --dry-run)", file=sys.stderr)
            return 2
        sizes = dict(dtype=torch.bfloat16, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                     block=BLOCK, decode_batch=DECODE_BATCH, contexts=CONTEXTS,
                     copy_bytes=1 << 30, prompts=CONTEXTS, prefill_tokens=PREFILL_TOKENS,
                     tokens=8192, hidden=4096, intermediate=14336,
                     quant_contexts=((4096, DECODE_BATCH), (32768, 16)))
    bench = Bench(args.dry_run)
    rows: list = []
    with torch.inference_mode():
        if "a" in args.sections:
            bench.guarded("decode", lambda: bench_decode(bench, sizes, rows))
        if "b" in args.sections:
            bench.guarded("prefill", lambda: bench_prefill(bench, sizes, rows))
        if "c" in args.sections:
            bench.guarded("small ops", lambda: bench_small_ops(bench, sizes, rows))
        if "d" in args.sections:
            bench.guarded("kv dtypes", lambda: bench_kv_dtypes(bench, sizes, rows))
    device = "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name()
    print(f"# kernels on {device}; torch {torch.__version__}; medians of triton do_bench")
    print_table(rows)
    for failure in bench.failures:
        print(f"FAILED {failure}")
    if args.json:
        report = dict(device=device, torch=torch.__version__, python=platform.python_version(),
                      dry_run=args.dry_run, failures=bench.failures,
                      sizes={k: (str(v) if isinstance(v, torch.dtype) else v)
                             for k, v in sizes.items()},
                      rows=[{k: (None if isinstance(v, float) and math.isnan(v) else v)
                             for k, v in r.items()} for r in rows])
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 1 if bench.failures else 0


if __name__ == "__main__":
    sys.exit(main())
