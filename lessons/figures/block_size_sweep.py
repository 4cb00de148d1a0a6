"""The block-size trade-off, measured: internal fragmentation versus block size (lesson 3's figure).

The script replays the same synthetic traces as benchmarks/memory_waste.py (ShareGPT-like: 3,000
requests at 1.0 per step; Alpaca-like: 10,000 requests at 20 per step; log-normal lengths fitted
to the paper's means, seed 0; the real datasets are not shipped, see reference/sim/traces.py)
through the paged allocator of reference/sim/simulator.py, in OPT-13B's KV budget on an A100-40GB
(12 GiB, 15,728 token slots), once per block size from 1 to 256 tokens. The trace sizes, rates,
budget and block sizes are imported from the benchmark, so the numbers are the benchmark's.

It plots, against the block size:

- internal fragmentation: allocated slots that hold no token (the empty tail of each running
  request's last block), in % of the KV memory;
- token states: slots that hold a token's K/V, in % of the KV memory,

averaged over the steps in which requests wait for memory, and writes block_size_sweep.png, its
Korean edition block_size_sweep.ko.png (figlang.py) and block_size_sweep.json (every number,
plus the mean number of requests running at once).

    .venv/bin/python lessons/figures/block_size_sweep.py           # about 15 s on one core
    .venv/bin/python lessons/figures/block_size_sweep.py --quick   # the benchmark's --quick traces
    .venv/bin/python lessons/figures/block_size_sweep.py --plot-only   # redraw from the .json
"""

import argparse
import importlib.util
import json
import time
from pathlib import Path

import figlang

from pagedllm.reference.kv_size import kv_size
from pagedllm.reference.sim.simulator import simulate
from pagedllm.reference.sim.traces import WORKLOADS, synthetic_trace

HERE = Path(__file__).resolve().parent
BENCHMARK = HERE.parents[1] / "benchmarks" / "memory_waste.py"
COLORS = {"sharegpt": "#2b6cb0", "alpaca": "#d97706"}
PAPER_BEST = {"sharegpt": (16, 128), "alpaca": (16, 32)}  # the paper's best block sizes


def load_benchmark():
    """benchmarks/memory_waste.py, loaded by file path (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("memory_waste", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sweep(quick: bool = False, seed: int = 0, model: str = "opt-13b",
          kv_gib: float = 12.0) -> dict:
    bench = load_benchmark()
    total_slots = bench.kv_budget_slots(model, kv_gib)
    max_len = kv_size(model).max_len
    out = {"config": {"model": model, "kv_gib": kv_gib, "total_slots": total_slots,
                      "max_len": max_len, "seed": seed, "quick": quick,
                      "block_sizes": list(bench.BLOCK_SIZES),
                      "measured": "steps in which a request waits for memory"},
           "workloads": {}}
    for name, (full, small, rate) in bench.TRACES.items():
        num_requests = small if quick else full
        trace = synthetic_trace(name, num_requests, rate, seed=seed, max_len=max_len)
        by_size = {}
        for block_size in bench.BLOCK_SIZES:
            result = simulate(trace, "paged", total_slots, max_len, block_size=block_size)
            by_size[str(block_size)] = bench.summary(result)
        out["workloads"][name] = {
            "trace": {"num_requests": num_requests, "rate_per_step": rate,
                      "distribution": "log-normal (synthetic; the real dataset is not shipped)",
                      "published_prompt_mean": WORKLOADS[name].prompt_mean,
                      "published_output_mean": WORKLOADS[name].output_mean},
            "block_sweep": by_size,
        }
    return out


def table(res: dict) -> str:
    sizes = res["config"]["block_sizes"]
    lines = [f"{'block size':24}" + "".join(f"{b:>7}" for b in sizes)]
    for name, data in res["workloads"].items():
        sw = data["block_sweep"]
        for label, key in (("internal frag %", "internal"), ("token states %", "token_states")):
            lines.append(f"{name + ' ' + label:24}"
                         + "".join(f"{sw[str(b)]['percent'][key]:7.1f}" for b in sizes))
        lines.append(f"{name + ' running':24}"
                     + "".join(f"{sw[str(b)]['mean_running']:7.1f}" for b in sizes))
    return "\n".join(lines)


def draw(res: dict, path: Path, lang: str = "en") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    T = figlang.chooser(lang)
    sizes = res["config"]["block_sizes"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.3))
    panels = (("internal", T("internal fragmentation (% of KV memory)",
                             "내부 단편화 (KV 메모리의 %)")),
              ("token_states", T("token states (% of KV memory)", "토큰 상태 (KV 메모리의 %)")))
    for ax, (key, ylabel) in zip(axes, panels, strict=True):
        for name, data in res["workloads"].items():
            ys = [data["block_sweep"][str(b)]["percent"][key] for b in sizes]
            n = data["trace"]["num_requests"]
            ax.plot(sizes, ys, "o-", color=COLORS[name], lw=2, ms=5,
                    label=T(f"{WORKLOADS[name].name} ({n:,} requests)",
                            f"{WORKLOADS[name].name.replace('-like', ' 유사')} (요청 {n:,}개)"))
            for b, y in zip(sizes, ys, strict=True):
                if b in (16, 256):
                    above = key == "internal" or (name == "sharegpt" and b == 16)
                    ax.annotate(f"{y:.1f}", (b, y), textcoords="offset points",
                                xytext=(-6, 7 if above else -15), ha="right", fontsize=9,
                                color=COLORS[name], fontweight="bold")
        ax.axvline(16, color="#555555", ls="--", lw=1)
        ax.text(16 * 1.08, 0.03 if key == "token_states" else 0.97,
                T("vLLM's default: 16", "vLLM의 기본값: 16"),
                transform=ax.get_xaxis_transform(), fontsize=8.5, color="#555555",
                va="bottom" if key == "token_states" else "top")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.set_xlabel(T("block size (tokens)", "블록 크기 (토큰)"))
        ax.set_ylabel(ylabel)
        if key == "token_states":
            ax.set_ylim(0, 105)
            ax.set_yticks(range(0, 101, 20))
        else:
            top = max(d["block_sweep"][str(b)]["percent"][key]
                      for d in res["workloads"].values() for b in sizes)
            ax.set_ylim(0, top * 1.12)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="upper left", bbox_to_anchor=(0.0, 0.9), fontsize=9, frameon=False)
    cfg = res["config"]
    setting = T(f"{cfg['model'].upper()}, {cfg['total_slots']:,} KV slots, synthetic traces",
                f"{cfg['model'].upper()}, KV 슬롯 {cfg['total_slots']:,}개, 합성 트레이스")
    fig.suptitle(T(f"Paged allocation: bigger blocks waste more of their last block ({setting})",
                   f"페이징 할당: 블록이 클수록 마지막 블록에서 더 많이 낭비한다 ({setting})"),
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the benchmark's smaller traces")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=HERE / "block_size_sweep.png")
    parser.add_argument("--plot-only", action="store_true",
                        help="redraw both editions from the .json beside --out, measuring nothing")
    args = parser.parse_args(argv)
    json_path = args.out.with_suffix(".json")
    if args.plot_only:
        for path in figlang.draw_both(draw, args.out, json.loads(json_path.read_text())):
            print(f"wrote {path}")
        return 0
    start = time.perf_counter()
    res = sweep(args.quick, args.seed)
    res["seconds"] = round(time.perf_counter() - start, 1)
    print(table(res))
    figlang.draw_both(draw, args.out, res)
    json_path.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {args.out} and {json_path} ({res['seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
