"""How far attention moves when it reads a quantized KV cache, per layer and kv_cache_dtype
(lesson 17's figure).

The shipped tiny model (4 layers, 2 KV heads of 32) reads the first WINDOW tokens of
``benchmarks/data/held_text.txt`` with no cache; every layer's q, k and v are recorded on the
way. Then, for each layer on its own (the exact q, k, v of the unquantized forward, so no error
carried over from earlier layers), the K/V are stored in a one-layer paged pool of each
kv_cache_dtype by the engine's own path (``PagedAttention.store``: quantize, scales, fp8
calibration) and attended to by ``paged_attention``, which dequantizes what it reads. The figure
plots the relative error of the attention output against the exact one,

    || out_quantized - out_exact || / || out_exact ||   (over all tokens and heads),

in two cases:

- the model as trained: its keys stay below 10, far inside every format's range;
- keys x 100, queries / 100: the scores q . k are the same (benchmarks/kv_quant.py scales the
  model's k_proj and q_proj the same way), so the exact output is too, but the stored keys now
  exceed 448, e4m3's largest value: fp8_e4m3 with vLLM's default k_scale = 1.0 clips them.

It also prints, per model, why int4 suffers more on some models than on others: how far a row's
largest |value| stands above its RMS (int4's 16 levels span the row's range), how often the
largest |key| of a token sits in the same channel (the outlier channels KIVI quantizes keys per
channel for), and the same after the Hadamard rotation the int4 cache stores its rows in.

    .venv/bin/python lessons/figures/kv_quant_error.py    # about 20 seconds, one thread
    .venv/bin/python lessons/figures/kv_quant_error.py --model smollm2-135m-instruct  # prints only
    .venv/bin/python lessons/figures/kv_quant_error.py --plot-only   # redraw from the .json

It writes kv_quant_error.json, kv_quant_error.png and its Korean edition kv_quant_error.ko.png
(figlang.py) next to itself (for the tiny model) and prints a table.
"""

import argparse
import json
from pathlib import Path

import figlang
import torch

from pagedllm.reference.kv import CacheEngine
from pagedllm.reference.model import AttentionMetadata, PagedAttention, resolve_model
from pagedllm.reference.model.cache import NoCache
from pagedllm.reference.model.loader import load_model, load_tokenizer
from pagedllm.reference.ops import dequantize_kv, quantize_kv
from pagedllm.reference.ops.kv_quant import hadamard, kv_cache_format

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TINY = ROOT / "pagedllm" / "models" / "tiny-pydoc"
HELD_TEXT = ROOT / "benchmarks" / "data" / "held_text.txt"
WINDOW, BLOCK_SIZE, GAIN = 256, 16, 100.0
# (label, kv_cache_dtype, calculate_kv_scales)
VARIANTS = [("fp8_e4m3", "fp8_e4m3", False), ("fp8_e4m3 calculated", "fp8_e4m3", True),
            ("fp8_e5m2", "fp8_e5m2", False), ("int8", "int8", False), ("int4", "int4", False)]
CASES = {"as trained": 1.0, f"keys x {GAIN:g}, queries / {GAIN:g}": GAIN}
COLORS = {"fp8_e4m3": "#2b6cb0", "fp8_e4m3 calculated": "#63b3ed", "fp8_e5m2": "#6b46c1",
          "int8": "#2f855a", "int4": "#c05621"}


class Recorder(NoCache):
    """No cache: attention over the tokens fed, recording every layer's q, k, v and output."""

    def __init__(self):
        self.seen = {}

    def attend(self, layer, q, k, v, positions, scale, sliding_window=None):
        out = super().attend(layer, q, k, v, positions, scale, sliding_window)
        self.seen[layer] = (q, k, v, positions, scale, out)
        return out


def paged_once(q, k, v, positions, scale, kv_cache_dtype, calculate) -> torch.Tensor:
    """One prefill of T tokens through a fresh one-layer pool in kv_cache_dtype."""
    T, kv_heads, head_dim = k.shape
    blocks = -(-T // BLOCK_SIZE)
    cache = CacheEngine(1, kv_heads, head_dim, BLOCK_SIZE, blocks, kv_cache_dtype=kv_cache_dtype,
                        calculate_kv_scales=calculate)
    md = AttentionMetadata(slot_mapping=torch.arange(T),
                           block_tables=torch.arange(blocks, dtype=torch.int32)[None],
                           seq_lens=torch.tensor([T], dtype=torch.int32),
                           query_start_loc=torch.tensor([0, T], dtype=torch.int32),
                           seq_lens_cpu=torch.tensor([T]), query_start_loc_cpu=torch.tensor([0, T]))
    attn = PagedAttention(md, cache.gpu_k, cache.gpu_v, quant=cache.quant)
    return attn.attend(0, q, k, v, positions, scale)


def row_stats(seen: dict) -> dict:
    """Per kind (k, v), averaged over layers: the median of a row's largest |x| over its RMS,
    as stored and Hadamard-rotated; the share of tokens whose largest |x| is in the head's most
    frequent channel (the most concentrated KV head of the layer); and the relative error of
    int8, and of int4 without and with the rotation (H is orthogonal: the error is the same
    rotated back)."""
    out = {}
    for kind, index in (("k", 1), ("v", 2)):
        stats = {key: [] for key in ("amax_over_rms", "amax_over_rms_rotated", "same_channel",
                                     "int8_error", "int4_error_unrotated", "int4_error")}
        for q_k_v in seen.values():
            x = q_k_v[index]  # [T, kv_heads, head_dim]
            rotated = x @ hadamard(x.shape[-1])
            for key, y in (("amax_over_rms", x), ("amax_over_rms_rotated", rotated)):
                rms = y.pow(2).mean(-1).sqrt()
                stats[key].append(float((y.abs().amax(-1) / rms).median()))
            top = x.abs().argmax(-1)  # [T, kv_heads]: each row's largest channel
            stats["same_channel"].append(max(float((top[:, h] == top[:, h].mode().values)
                                                   .float().mean()) for h in range(x.shape[1])))
            for key, name, y in (("int8_error", "int8", x), ("int4_error_unrotated", "int4", x),
                                 ("int4_error", "int4", rotated)):
                back = dequantize_kv(*quantize_kv(y, name), name, torch.float32)
                stats[key].append(float((y - back).norm() / y.norm()))
        out[kind] = {key: sum(values) / len(values) for key, values in stats.items()}
    return out


def measure(model_dir: Path) -> dict:
    torch.manual_seed(0)
    tokenizer = load_tokenizer(model_dir)
    ids = tokenizer.encode(HELD_TEXT.read_text())[:WINDOW]
    model = load_model(model_dir, dtype=torch.float32)
    recorder = Recorder()
    with torch.inference_mode():
        model(torch.tensor(ids), torch.arange(len(ids)), recorder)
    cfg = model.config
    out = {"model": model_dir.name, "tokens": len(ids), "head_dim": cfg.head_dim,
           "kv_heads": cfg.num_kv_heads, "layers": cfg.num_layers, "cases": {},
           "rows": row_stats(recorder.seen),
           "bytes_per_token_head": {label: kv_cache_format(dt).bytes_per_token_head(
               cfg.head_dim, 2) for label, dt, _ in [("auto (bf16)", "auto", False), *VARIANTS]}}
    for case, gain in CASES.items():
        rows = {label: [] for label, _, _ in VARIANTS}
        key_absmax = []
        for layer in range(cfg.num_layers):
            q, k, v, positions, scale, exact = recorder.seen[layer]
            q, k = q / gain, k * gain  # the same scores: q . k unchanged
            key_absmax.append(float(k.abs().max()))
            with torch.inference_mode():
                for label, kv_dtype, calculate in VARIANTS:
                    got = paged_once(q, k, v, positions, scale, kv_dtype, calculate)
                    rows[label].append(float((got - exact).norm() / exact.norm()))
        out["cases"][case] = {"key_absmax": key_absmax, "relative_error": rows}
    return out


def draw(result: dict, path: Path, lang: str = "en") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    T = figlang.chooser(lang)
    cases_ko = {"as trained": "학습된 그대로", "keys x 100, queries / 100": "키 x 100, 쿼리 / 100"}
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.4), sharey=True)
    layers = list(range(result["layers"]))
    width = 0.8 / len(VARIANTS)
    bf16 = result["bytes_per_token_head"]["auto (bf16)"]
    for ax, (case, data) in zip(axes, result["cases"].items(), strict=True):
        for i, (label, _, _) in enumerate(VARIANTS):
            x = [layer + (i - (len(VARIANTS) - 1) / 2) * width for layer in layers]
            ratio = bf16 / result["bytes_per_token_head"][label]
            ax.bar(x, data["relative_error"][label], width, color=COLORS[label],
                   label=T(f"{label} ({ratio:.2f}x the tokens of bf16)",
                           f"{label} (bf16의 {ratio:.2f}배 토큰)"))
        kmax = max(data["key_absmax"])
        ax.set_title(T(f"{case}: largest |key| {kmax:,.0f}",
                       f"{cases_ko.get(case, case)}: 가장 큰 |키| {kmax:,.0f}"), fontsize=10)
        ax.set_xticks(layers, [T(f"layer {layer}", f"레이어 {layer}") for layer in layers])
        ax.set_yscale("log")
        ax.grid(alpha=0.3, axis="y", which="both")
    axes[0].set_ylabel(T("relative error of the attention output", "어텐션 출력의 상대 오차"))
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=3, frameon=False)
    fig.suptitle(T(f"Attention over a quantized KV cache, {result['model']} "
                   f"(head_dim {result['head_dim']}, {result['tokens']} tokens, each layer alone)",
                   f"양자화한 KV 캐시 위의 어텐션, {result['model']} "
                   f"(head_dim {result['head_dim']}, 토큰 {result['tokens']}개, 레이어마다 따로)"),
                 fontsize=11)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="another model: print its numbers, write "
                   "nothing (default: the tiny model, whose figure is drawn)")
    p.add_argument("--plot-only", action="store_true",
                   help="redraw both editions from kv_quant_error.json, measuring nothing")
    args = p.parse_args(argv)
    if args.plot_only:
        result = json.loads((HERE / "kv_quant_error.json").read_text())
        figlang.draw_both(draw, HERE / "kv_quant_error.png", result)
        return
    torch.set_num_threads(1)
    result = measure(Path(resolve_model(args.model)) if args.model else TINY)
    if args.model is None:
        (HERE / "kv_quant_error.json").write_text(json.dumps(result, indent=1) + "\n")
        figlang.draw_both(draw, HERE / "kv_quant_error.png", result)
    print(f"{result['model']}, {result['tokens']} tokens, head_dim {result['head_dim']}:")
    for kind, r in result["rows"].items():
        print(f"  {kind}: a row's largest |{kind}| / its RMS {r['amax_over_rms']:.2f} (median; "
              f"rotated {r['amax_over_rms_rotated']:.2f}), in the same channel for "
              f"{r['same_channel']:.0%} of tokens; error int8 {r['int8_error']:.2%}, int4 "
              f"{r['int4_error_unrotated']:.1%} (rotated {r['int4_error']:.1%})")
    for case, data in result["cases"].items():
        print(f"{case} (largest |key| per layer: "
              f"{', '.join(f'{m:,.1f}' for m in data['key_absmax'])})")
        for label, errors in data["relative_error"].items():
            print(f"  {label:22s} " + "  ".join(f"{e:8.2e}" for e in errors))


if __name__ == "__main__":
    main()
