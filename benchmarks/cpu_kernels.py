"""Our CPU kernels against torch's on one decode step's products (lesson 18).

The weights are a model's (by default the shipped tiny model; ``--model
smollm2-135m-instruct`` for the real one): every product of one decode step (each layer's
merged QKV, o_proj, merged gate/up and down_proj, and the LM head), multiplied one after the
other as a forward does, so that each weight comes from memory rather than from a warm cache.
Six ways, at a few row counts:

- int8 per channel (every product but the LM head, which a quantized model keeps in bf16):
  torch's ``_weight_int8pack_mm`` and ours (``optimized/csrc/cpu_ops.cpp``);
- int4 in groups of 32 (the same products): torch's ``_weight_int4pack_mm_for_cpu`` and ours;
- bf16 (every product, the head included): ``F.linear`` (oneDNN) and ours.

One torch thread, this thread's CPU time, the median of --repeats runs (min-max beside it), and
the weight bytes each way reads per step over that time.

    python benchmarks/cpu_kernels.py --model smollm2-135m-instruct
    python benchmarks/cpu_kernels.py --rows 1,4,16,64 --repeats 7
"""

import argparse
import json
import statistics
from pathlib import Path

import torch

from pagedllm.benchmarks.linear_layout import seconds
from pagedllm.benchmarks.progress import progress, say
from pagedllm.kernels.cpu_ops import cpu_kernels
from pagedllm.optimized.layers import merge_projections
from pagedllm.optimized.quant_layers import (
    Int4PackedLinear,
    Int8PackedLinear,
    PackedBF16Linear,
    PackedInt4Linear,
    PackedInt8Linear,
)
from pagedllm.reference.model.loader import load_model
from pagedllm.reference.model.quantization import QuantizedLinear
from pagedllm.reference.model.registry import resolve_model
from pagedllm.reference.ops.weight_quant import quantize_int4, quantize_int8
from pagedllm.serving.default_model import default_model_dir


def step_weights(model_dir) -> list[tuple[str, torch.Tensor]]:
    """(name, [out, in] bf16 weight) of one decode step's products, in the forward's order."""
    model = merge_projections(load_model(model_dir, dtype=torch.bfloat16))
    return [(name, m.weight.detach()) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear)]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a model name or folder (default: the tiny "
                    "model)")
    ap.add_argument("--rows", default="1,16,64", help="comma-separated rows per product")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls", type=int, default=20, help="steps' products per run")
    ap.add_argument("--json", type=Path, default=None, help="write the numbers here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    kernels = cpu_kernels()
    if kernels is None:
        print("this CPU has no AVX-512 BF16 (or the kernel did not build): nothing to compare")
        return {"skipped": "no AVX-512 BF16 or no build"}
    model_dir = resolve_model(args.model) if args.model else default_model_dir()
    weights = step_weights(model_dir)
    int8 = [QuantizedLinear(quantize_int8(w), None) for name, w in weights
            if not name.endswith("lm_head")]
    int4 = [QuantizedLinear(quantize_int4(w, 32), None) for name, w in weights
            if not name.endswith("lm_head")]
    linears = []
    for _, w in weights:
        linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16)
        linear.weight = torch.nn.Parameter(w, requires_grad=False)
        linears.append(linear)
    ways = {  # name: (the step's modules, their inputs' sizes)
        "int8, torch": ([Int8PackedLinear(m, torch.bfloat16) for m in int8], int8),
        "int8, ours": ([PackedInt8Linear(m, kernels) for m in int8], int8),
        "int4 g32, torch": ([Int4PackedLinear(m, torch.bfloat16) for m in int4], int4),
        "int4 g32, ours": ([PackedInt4Linear(m, kernels) for m in int4], int4),
        "bf16, F.linear": (linears, linears),
        "bf16, ours": ([PackedBF16Linear(m, kernels) for m in linears], linears),
    }
    sizes = {name: sum(sum(t.numel() * t.element_size() for t in [*m.buffers(), *m.parameters()])
                       for m in mods) for name, (mods, _) in ways.items()}
    print(f"{model_dir.name}: {len(weights)} products a step; ms per step's products, "
          f"median (min-max) of {args.repeats}, and GB/s of weights read")
    print(f"{'rows':>4}  " + "  ".join(f"{name:>26}" for name in ways))
    results = {"model": str(model_dir.name), "weight_bytes": sizes, "rows": {}}
    all_rows = [int(r) for r in args.rows.split(",")]
    bar = progress(None, "rows x ways", total=len(all_rows) * len(ways), unit="way")
    for rows in all_rows:
        cells, row = [], {}
        for name, (mods, shapes) in ways.items():
            bar.set_postfix_str(f"{rows} rows, {name}")
            xs = [torch.randn(rows, m.in_features).bfloat16() for m in shapes]
            def step(mods=mods, xs=xs):
                return [m(x) for m, x in zip(mods, xs, strict=True)]

            with torch.inference_mode():
                runs = seconds(step, args.calls, args.repeats)
            ms = statistics.median(runs) * 1e3
            row[name] = {"ms": ms, "min_ms": min(runs) * 1e3, "max_ms": max(runs) * 1e3,
                         "gb_per_s": sizes[name] / (ms / 1e3) / 1e9}
            cells.append(f"{ms:7.2f} ({min(runs) * 1e3:.2f}-{max(runs) * 1e3:.2f}) "
                         f"{row[name]['gb_per_s']:5.1f}")
            bar.update()
        results["rows"][rows] = row
        say(f"{rows:>4}  " + "  ".join(f"{c:>26}" for c in cells))
    bar.close()
    print("weight bytes a step: " + ", ".join(f"{n} {b / 1e6:.1f} MB" for n, b in sizes.items()))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
