"""Bytes the small ops move, one torch op at a time versus fused (lesson 13's figure).

Llama-3-8B in bf16 (hidden 4096, intermediate 14336, 32 query and 8 K/V heads of 128, a
vocabulary of 128256). For each op, per token (per sampled row for the sampler):

- **unfused**: the reference's torch code (``reference/ops/``), op by op; every op reads its
  inputs from memory and writes its output back. Views (``chunk``, slicing) move nothing. Small
  per-row tensors (a row's mean, its temperature) and the weights, read once per launch for
  the whole batch, are left out.
- **fused**: what the Triton kernel loads and stores (``kernels/``).

The sampler is counted for a drawn row without top-k/top-p and without logprobs: the float64
and int64 tensors of its random numbers ([rows, vocab] each) dominate. Its kernel reads the row
of logits four times (passes) and writes a few numbers; the row is 501 KiB, which the L2 cache
can keep between passes, so its HBM traffic is between one and four reads of the row.

    .venv/bin/python lessons/figures/fusion_bytes.py    # under a second

It writes fusion_bytes.json, fusion_bytes.png and its Korean edition fusion_bytes.ko.png
(figlang.py) next to itself and prints the table.
"""

import json
from pathlib import Path

import figlang

HERE = Path(__file__).resolve().parent
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 4096, 14336, 32, 8, 128, 128256
BF16, F32, F64, I64 = 2, 4, 8, 8


def rms_norm_ops() -> list[tuple[str, int, int]]:
    """reference/ops/layernorm.py with a residual: (op, bytes read, bytes written) per token."""
    h = HIDDEN
    return [("x + residual", 2 * h * BF16, h * BF16),
            ("x.float()", h * BF16, h * F32),
            ("pow(2)", h * F32, h * F32),
            ("mean", h * F32, 0),
            ("x32 * rsqrt(...)", h * F32, h * F32),
            (".to(bf16)", h * F32, h * BF16),
            ("weight * normed", h * BF16, h * BF16)]


def silu_and_mul_ops() -> list[tuple[str, int, int]]:
    d = INTER
    return [("silu(gate)", d * BF16, d * BF16),
            ("* up", 2 * d * BF16, d * BF16)]


def rotary_ops() -> list[tuple[str, int, int]]:
    """reference/ops/rotary.py: the cos/sin tables once, then rotate() for q and for k."""
    table = HEAD_DIM * F32
    ops = [("angles", HEAD_DIM // 2 * F32, HEAD_DIM // 2 * F32),
           ("cat(angles)", HEAD_DIM // 2 * F32, table),
           ("cos, sin", 2 * table, 2 * table)]
    for name, heads in (("q", HEADS), ("k", KV_HEADS)):
        e = heads * HEAD_DIM * BF16
        ops += [(f"{name}: -second", e // 2, e // 2),
                (f"{name}: cat", e, e),
                (f"{name}: cos, sin .to(bf16)", 2 * table, 2 * HEAD_DIM * BF16),
                (f"{name}: x * cos", e + HEAD_DIM * BF16, e),
                (f"{name}: rotated * sin", e + HEAD_DIM * BF16, e),
                (f"{name}: add", 2 * e, e)]
    return ops


def sample_ops() -> list[tuple[str, int, int]]:
    """reference/ops/sampling.py, one drawn row, no cuts, no logprobs asked."""
    v = VOCAB
    mix64 = [("shift", v * I64, v * I64), ("mask", v * I64, v * I64),
             ("xor", 2 * v * I64, v * I64), ("mul", v * I64, v * I64)]
    ops = [("log_softmax", v * F32, v * F32),
           ("blocked mask", 0, v),
           ("masked_fill", v * F32 + v, v * F32),
           ("argmax (greedy)", v * F32, 0),
           ("logits[drawn]", v * F32, v * F32),
           ("/ temperature", v * F32, v * F32),
           ("softmax", v * F32, v * F32),
           (".double()", v * F32, v * F64),
           ("sum", v * F64, 0),
           ("/ sum", v * F64, v * F64),
           ("arange tokens", 0, v * I64),
           ("tokens + 1", v * I64, v * I64),
           ("* gamma", v * I64, v * I64),
           ("b + ...", v * I64, v * I64)]
    ops += [(f"mix64 {n}", r, w) for n, r, w in mix64 * 2]  # two rounds of shift, xor, mul
    ops += [("mix64 shift", v * I64, v * I64), ("mix64 mask", v * I64, v * I64),
            ("mix64 xor", 2 * v * I64, v * I64),
            (">>> 12", 2 * v * I64, v * I64),  # shift and mask
            (".double() + 0.5", 2 * v * I64, 2 * v * F64),
            ("* 2**-52", v * F64, v * F64),
            ("log", v * F64, v * F64),
            ("negate", v * F64, v * F64),
            ("probs / E", 2 * v * F64, v * F64),
            ("argmax (race)", v * F64, 0)]
    return ops


FUSED = {  # what each kernel loads and stores, per token (per row for the sampler)
    "RMSNorm + residual": 4 * HIDDEN * BF16,  # x, residual in; out, new residual out
    "SiLU and mul": 3 * INTER * BF16,  # gate, up in; out
    "rotary (q and k)": 2 * (HEADS + KV_HEADS) * HEAD_DIM * BF16,  # in place: read, write
    "sampling (one row)": 4 * VOCAB * F32,  # four passes over the row, at most
}
UNFUSED = {"RMSNorm + residual": rms_norm_ops, "SiLU and mul": silu_and_mul_ops,
           "rotary (q and k)": rotary_ops, "sampling (one row)": sample_ops}


def compute() -> dict:
    out = {}
    for name, ops in UNFUSED.items():
        listed = ops()
        unfused = sum(r + w for _, r, w in listed)
        out[name] = {"unfused_bytes": unfused, "fused_bytes": FUSED[name],
                     "ratio": round(unfused / FUSED[name], 2), "ops": len(listed)}
    return out


def draw(res: dict, path: Path, lang: str = "en") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    T = figlang.chooser(lang)
    names = list(res)
    shown = {"RMSNorm + residual": "RMSNorm + 잔차", "SiLU and mul": "SiLU와 곱",
             "rotary (q and k)": "회전 (q와 k)", "sampling (one row)": "샘플링 (행 하나)"}
    fig, ax = plt.subplots(figsize=(8.5, 3.8))
    y = range(len(names))
    kib = 1024
    ax.barh([i + 0.2 for i in y], [res[n]["unfused_bytes"] / kib for n in names], height=0.4,
            color="#c53030", label=T("one torch op at a time (reference)",
                                     "torch 연산을 하나씩 (레퍼런스)"))
    ax.barh([i - 0.2 for i in y], [res[n]["fused_bytes"] / kib for n in names], height=0.4,
            color="#2b6cb0", label=T("fused (Triton kernel)", "융합 (Triton 커널)"))
    for i, n in zip(y, names, strict=True):
        ax.text(res[n]["unfused_bytes"] / kib * 1.1, i + 0.2,
                f"{res[n]['unfused_bytes'] / kib:,.0f} KiB ({res[n]['ratio']:.1f}x)",
                va="center", fontsize=8)
        ax.text(res[n]["fused_bytes"] / kib * 1.1, i - 0.2,
                f"{res[n]['fused_bytes'] / kib:,.0f} KiB", va="center", fontsize=8)
    ax.set_yticks(list(y), [T(n, shown.get(n, n)) for n in names])
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlim(10, 3e5)
    ax.set_xlabel(T("bytes moved per token (per sampled row), KiB, log scale",
                    "토큰당(샘플링하는 행당) 옮긴 바이트, KiB, 로그 눈금"))
    ax.set_title(T("Llama-3-8B, bf16: memory traffic of the small ops",
                   "Llama-3-8B, bf16: 작은 연산의 메모리 트래픽"), fontsize=11)
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(alpha=0.3, axis="x", which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main() -> None:
    res = compute()
    (HERE / "fusion_bytes.json").write_text(json.dumps(res, indent=1) + "\n")
    figlang.draw_both(draw, HERE / "fusion_bytes.png", res)
    for name, r in res.items():
        print(f"  {name:20} {r['ops']:2} ops  unfused {r['unfused_bytes']:>11,} B   "
              f"fused {r['fused_bytes']:>9,} B   {r['ratio']:5.1f}x")


if __name__ == "__main__":
    main()
