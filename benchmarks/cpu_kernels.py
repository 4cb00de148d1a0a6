"""Our CPU kernels against torch's on one decode step's products (lesson 18).

The weights are a model's (by default the shipped tiny model; ``--model
smollm2-135m-instruct`` for the real one): every product of one decode step (each layer's
merged QKV, o_proj, merged gate/up and down_proj, and the LM head), multiplied one after the
other as a forward does, so that each weight comes from memory rather than from a warm cache.

bf16 activations (a bf16 model; our kernels on the machine's best path):

- int8 per channel (every product but the LM head, which a quantized model keeps in bf16):
  torch's ``_weight_int8pack_mm`` and ours (``kernels/cpu/quant_linear.cpp``);
- int4 in groups of 32 (the same products): torch's ``_weight_int4pack_mm_for_cpu`` and ours;
- fp8 (e4m3) per channel (the same products): ours (torch has no weight-only e4m3 kernel on the
  CPU: the twin dequantizes the whole weight every call);
- bf16 (every product, the head included): ``F.linear`` (oneDNN) and ours.

float32 activations (a float32 model: what a CPU without native bf16 computes in), every
product the head included (a comparison of kernels over all of a step's shapes; a quantized
model keeps its head in float): ``F.linear`` on float32 weights (BLAS), torch's int8 and int4
kernels on float32 activations, the fp8 twin, and ours (int8, int4 g32, fp8) on each
instruction-set path of ``--isas`` that this machine has, at most the path the kernels take now
(``use_isa``; ``PAGEDLLM_CPU_ISA`` caps it: ``avx2`` is what an AVX2-only CPU such as AMD Zen 2
runs, and with ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` torch's kernels are capped
alike). ``--ways`` keeps the ways whose name matches a regular expression (each group's
``F.linear`` is kept while any of its group is: the speeds are against it).

One torch thread, this thread's CPU time, the median of --repeats runs (min-max in the JSON),
the weight bytes each way reads per step over that time, and each way's speed against its
group's ``F.linear``.

    python benchmarks/cpu_kernels.py --model smollm2-135m-instruct
    python benchmarks/cpu_kernels.py --rows 1,4,16,64 --repeats 7
    PAGEDLLM_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
        python benchmarks/cpu_kernels.py --model smollm2-135m-instruct --ways 'fp32, ours'
"""

import argparse
import contextlib
import json
import platform
import re
import statistics
from pathlib import Path

import torch

from pagedllm.benchmarks.linear_layout import seconds
from pagedllm.benchmarks.progress import progress, say
from pagedllm.kernels.cpu_ops import (
    ISAS,
    cpu_isa,
    cpu_kernels,
    cpu_kernels_status,
    use_isa,
)
from pagedllm.optimized.layers import merge_projections
from pagedllm.optimized.quant_layers import (
    Int4PackedLinear,
    Int8PackedLinear,
    PackedBF16Linear,
    PackedFp8Linear,
    PackedInt4Linear,
    PackedInt8Linear,
)
from pagedllm.reference.model.loader import load_model
from pagedllm.reference.model.quantization import QuantizedLinear
from pagedllm.reference.model.registry import resolve_model
from pagedllm.reference.ops.weight_quant import quantize_fp8, quantize_int4, quantize_int8
from pagedllm.serving.default_model import default_model_dir


def step_weights(model_dir) -> list[tuple[str, torch.Tensor]]:
    """(name, [out, in] bf16 weight) of one decode step's products, in the forward's order."""
    model = merge_projections(load_model(model_dir, dtype=torch.bfloat16))
    return [(name, m.weight.detach()) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear)]


def cpu_name() -> str:
    """The CPU's model name (Linux), for the table's header."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def linear(w: torch.Tensor) -> torch.nn.Linear:
    module = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
    module.weight = torch.nn.Parameter(w, requires_grad=False)
    return module


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a model name or folder (default: the tiny "
                    "model)")
    ap.add_argument("--rows", default="1,16,64", help="comma-separated rows per product")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls", type=int, default=20, help="steps' products per run")
    ap.add_argument("--isas", default="avx512,avx2", help="our kernels' paths to time on "
                    "float32 activations (those this machine has)")
    ap.add_argument("--ways", default="", help="a regular expression: time only the ways "
                    "whose name matches it (and each group's F.linear)")
    ap.add_argument("--json", type=Path, default=None, help="write the numbers here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    kernels = cpu_kernels()
    if kernels is None:
        print(f"our CPU kernels did not build ({cpu_kernels_status()}): nothing to compare")
        return {"skipped": cpu_kernels_status()}
    machine = cpu_isa()  # the machine's best path, or PAGEDLLM_CPU_ISA's cap
    isas = [i for i in args.isas.split(",") if ISAS.index(i) >= ISAS.index(machine)]
    model_dir = resolve_model(args.model) if args.model else default_model_dir()
    weights = step_weights(model_dir)
    int8 = [QuantizedLinear(quantize_int8(w), None) for name, w in weights
            if not name.endswith("lm_head")]
    int4 = [QuantizedLinear(quantize_int4(w, 32), None) for name, w in weights
            if not name.endswith("lm_head")]
    linears = [linear(w) for _, w in weights]
    f32 = [linear(w.float()) for _, w in weights]  # float32 weights, the head included
    int8_f32 = [QuantizedLinear(quantize_int8(w.float()), None) for _, w in weights]
    int4_f32 = [QuantizedLinear(quantize_int4(w.float(), 32), None) for _, w in weights]
    fp8 = [QuantizedLinear(quantize_fp8(w), None) for name, w in weights
           if not name.endswith("lm_head")]
    fp8_f32 = [QuantizedLinear(quantize_fp8(w.float()), None) for _, w in weights]
    bf16, fp32 = torch.bfloat16, torch.float32
    ways = {  # name: (the step's modules, their inputs' sizes, x's dtype, our path or None)
        "int8, torch": ([Int8PackedLinear(m, bf16) for m in int8], int8, bf16, None),
        "int8, ours": ([PackedInt8Linear(m, kernels) for m in int8], int8, bf16, machine),
        "int4 g32, torch": ([Int4PackedLinear(m, bf16) for m in int4], int4, bf16, None),
        "int4 g32, ours": ([PackedInt4Linear(m, kernels) for m in int4], int4, bf16, machine),
        "fp8, ours": ([PackedFp8Linear(m, kernels) for m in fp8], fp8, bf16, machine),
        "bf16, F.linear": (linears, linears, bf16, None),
        "bf16, ours": ([PackedBF16Linear(m, kernels) for m in linears], linears, bf16, machine),
        "fp32, F.linear": (f32, f32, fp32, None),
        "int8 fp32, torch": ([Int8PackedLinear(m, fp32) for m in int8_f32], f32, fp32, None),
        "int4 g32 fp32, torch": ([Int4PackedLinear(m, fp32) for m in int4_f32], f32, fp32,
                                 None),
        "fp8 fp32, twin": (fp8_f32, f32, fp32, None),
    }
    for isa in isas:
        ways[f"int8 fp32, ours {isa}"] = (
            [PackedInt8Linear(m, kernels) for m in int8_f32], f32, fp32, isa)
        ways[f"int4 g32 fp32, ours {isa}"] = (
            [PackedInt4Linear(m, kernels) for m in int4_f32], f32, fp32, isa)
        ways[f"fp8 fp32, ours {isa}"] = (
            [PackedFp8Linear(m, kernels) for m in fp8_f32], f32, fp32, isa)
    wanted = re.compile(args.ways)
    kept = {name for name in ways if wanted.search(name)}
    groups = {ways[name][2] for name in kept}  # the activations' dtypes still timed
    ways = {name: way for name, way in ways.items()
            if name in kept or (name.endswith("F.linear") and way[2] in groups)}
    sizes = {name: sum(sum(t.numel() * t.element_size() for t in [*m.buffers(), *m.parameters()])
                       for m in mods) for name, (mods, *_) in ways.items()}
    all_rows = [int(r) for r in args.rows.split(",")]
    results = {"model": str(model_dir.name), "cpu": cpu_name(), "machine_isa": machine,
               "weight_bytes": sizes, "rows": {rows: {} for rows in all_rows}}
    bar = progress(None, "rows x ways", total=len(all_rows) * len(ways), unit="way")
    for rows in all_rows:
        row = results["rows"][rows]
        for name, (mods, shapes, dtype, isa) in ways.items():
            bar.set_postfix_str(f"{rows} rows, {name}")
            xs = [torch.randn(rows, m.in_features).to(dtype) for m in shapes]
            def step(mods=mods, xs=xs):
                return [m(x) for m, x in zip(mods, xs, strict=True)]

            with torch.inference_mode(), use_isa(isa) if isa else contextlib.nullcontext():
                runs = seconds(step, args.calls, args.repeats)
            ms = statistics.median(runs) * 1e3
            row[name] = {"ms": ms, "min_ms": min(runs) * 1e3, "max_ms": max(runs) * 1e3,
                         "gb_per_s": sizes[name] / (ms / 1e3) / 1e9}
            bar.update()
    bar.close()
    base = {bf16: "bf16, F.linear", fp32: "fp32, F.linear"}  # each way against its group's
    for cells in results["rows"].values():
        for way, (_, _, dtype, _) in ways.items():
            cells[way]["vs_f_linear"] = cells[base[dtype]]["ms"] / cells[way]["ms"]
    say(f"{model_dir.name} on {results['cpu']} (machine path {machine}), 1 thread: ms per "
        f"step's products (median of {args.repeats}), GB/s of weights read, and the speed "
        f"against its group's F.linear")
    say(f"{'way':<26} {'MB':>6}  " + "  ".join(f"{f'{r} rows':>22}" for r in all_rows))
    for name in ways:
        cells = [results["rows"][r][name] for r in all_rows]
        say(f"{name:<26} {sizes[name] / 1e6:6.1f}  " + "  ".join(
            f"{c['ms']:8.2f} {c['gb_per_s']:5.1f} {c['vs_f_linear']:5.2f}x" for c in cells))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
