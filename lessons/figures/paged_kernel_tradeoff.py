"""A slower kernel in a faster system: decode throughput against the attention kernel's slowdown
(lesson 10's figure).

A decode step is memory-bound: its time is at least (weight bytes + KV bytes read) / bandwidth.
The script models one decode step of OPT-13B (fp16, about 26 GB of weights) on the
A100-40GB budget of lessons 2 and 3 (15,728 token slots of 800 KiB), for the three allocators
of lesson 2's table (`benchmarks/memory_waste.py`, ShareGPT-like trace, seed 0):

- how many requests run at once (Orca (Max) 7.0, Orca (Oracle) 16.2, paged 31.2);
- how many slots hold a token's K/V, which the step must read (21.9 %, 50.5 % and 97.0 %).

The contiguous allocators get a kernel that reads K/V at full speed. The paged one gets a kernel
whose K/V reads take ``slowdown`` times as long; the paper measured its kernel 20-26 % slower in
isolation (slowdown 1.20-1.26). Throughput is requests per step time, shown relative to Orca
(Max), so the bandwidth cancels out. The break-even slowdown, where paging would lose to Oracle,
is printed too.

    .venv/bin/python lessons/figures/paged_kernel_tradeoff.py    # under a second

It writes paged_kernel_tradeoff.json (every number), paged_kernel_tradeoff.png and its Korean
edition paged_kernel_tradeoff.ko.png (figlang.py) next to itself.
"""

import json
from pathlib import Path

import figlang

from pagedllm.reference.kv_size import kv_size

HERE = Path(__file__).resolve().parent
SLOTS = 15_728  # OPT-13B's KV budget on an A100-40GB, in token slots (lessons 2 and 3)
WEIGHT_BYTES = 13e9 * 2  # about 13 billion parameters in fp16
# Lesson 2's table: requests running at once, and share of the slots holding token states.
ALLOCATORS = {
    "Orca (Max)": (7.0, 0.219),
    "Orca (Oracle)": (16.2, 0.505),
    "vLLM (paged)": (31.2, 0.970),
}
PAPER_SLOWDOWN = (1.20, 1.26)
COLORS = {"Orca (Max)": "#9a5200", "Orca (Oracle)": "#d97706", "vLLM (paged)": "#2b6cb0"}


def step_bytes(token_share: float, slowdown: float = 1.0) -> float:
    """Bytes a decode step must move, with the KV part stretched by the kernel's slowdown."""
    kv_bytes = token_share * SLOTS * kv_size("opt-13b").bytes_per_token
    return WEIGHT_BYTES + slowdown * kv_bytes


def throughput(name: str, slowdown: float = 1.0) -> float:
    """Requests (tokens) per step, per byte-time: proportional to tokens per second."""
    running, share = ALLOCATORS[name]
    return running / step_bytes(share, slowdown)


def compute() -> dict:
    base = throughput("Orca (Max)")
    slowdowns = [round(1 + 0.05 * i, 2) for i in range(41)]  # 1.00 .. 3.00
    oracle = throughput("Orca (Oracle)")
    paged_kv = ALLOCATORS["vLLM (paged)"][1] * SLOTS * kv_size("opt-13b").bytes_per_token
    # paged == oracle:  running / (W + s * kv) = oracle  ->  s = (running / oracle - W) / kv
    break_even = (ALLOCATORS["vLLM (paged)"][0] / oracle - WEIGHT_BYTES) / paged_kv
    return {
        "config": {"model": "opt-13b", "slots": SLOTS, "weight_bytes": WEIGHT_BYTES,
                   "bytes_per_token": kv_size("opt-13b").bytes_per_token,
                   "allocators": {k: {"running": r, "token_share": s}
                                  for k, (r, s) in ALLOCATORS.items()}},
        "relative_to_max": {
            "Orca (Max)": 1.0,
            "Orca (Oracle)": round(oracle / base, 3),
            "paged, contiguous-speed kernel": round(throughput("vLLM (paged)", 1.0) / base, 3),
            "paged, kernel 20 % slower": round(throughput("vLLM (paged)", 1.20) / base, 3),
            "paged, kernel 26 % slower": round(throughput("vLLM (paged)", 1.26) / base, 3),
        },
        "break_even_slowdown_vs_oracle": round(break_even, 2),
        "sweep": {"slowdown": slowdowns,
                  "paged": [round(throughput("vLLM (paged)", s) / base, 3) for s in slowdowns]},
    }


def draw(res: dict, path: Path, lang: str = "en") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    T = figlang.chooser(lang)
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    sweep = res["sweep"]
    ax.plot(sweep["slowdown"], sweep["paged"], color=COLORS["vLLM (paged)"], lw=2.2,
            label=T("vLLM (paged): 31.2 requests, slower K/V reads",
                    "vLLM (페이징): 요청 31.2개, 더 느린 K/V 읽기"))
    rel = res["relative_to_max"]
    for name in ("Orca (Oracle)", "Orca (Max)"):
        running = ALLOCATORS[name][0]
        ax.axhline(rel[name], color=COLORS[name], ls="--", lw=1.5,
                   label=T(f"{name}: {running:g} requests, contiguous kernel",
                           f"{name}: 요청 {running:g}개, 연속 커널"))
    ax.axvspan(*PAPER_SLOWDOWN, color="#2b6cb0", alpha=0.15,
               label=T("the paper's kernel: 20-26 % slower", "논문의 커널: 20-26 % 더 느림"))
    be = res["break_even_slowdown_vs_oracle"]
    ax.axvline(be, color="grey", lw=1, ls=":")
    ax.annotate(T(f"break-even with Oracle\nat {be:.1f}× slower",
                  f"{be:.1f}배 느릴 때\nOracle과 같아짐"), (be, rel["Orca (Oracle)"]),
                xytext=(be - 0.7, rel["Orca (Oracle)"] - 0.75), fontsize=9,
                arrowprops={"arrowstyle": "->", "color": "grey"})
    ax.set_xlabel(T("paged attention kernel's K/V read time, relative to a contiguous kernel",
                    "페이지드 어텐션 커널의 K/V 읽기 시간, 연속 커널 대비"))
    ax.set_ylabel(T("decode throughput, relative to Orca (Max)",
                    "디코드 처리량, Orca (Max) 대비"))
    ax.set_title(T("OPT-13B, 12 GiB of KV: a slower kernel over a bigger batch",
                   "OPT-13B, KV 12 GiB: 더 큰 배치 위의 더 느린 커널"), fontsize=11)
    ax.set_xlim(1, 3)
    ax.set_ylim(0, 4)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main() -> None:
    res = compute()
    (HERE / "paged_kernel_tradeoff.json").write_text(json.dumps(res, indent=1) + "\n")
    figlang.draw_both(draw, HERE / "paged_kernel_tradeoff.png", res)
    for name, value in res["relative_to_max"].items():
        print(f"  {name:32} {value:.2f}x Orca (Max)")
    print(f"  paged loses to Oracle only past a {res['break_even_slowdown_vs_oracle']:.1f}x "
          "slower K/V read")


if __name__ == "__main__":
    main()
