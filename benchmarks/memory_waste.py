"""Where does KV memory go? The PagedAttention paper's Figure 2, reproduced by simulation.

The paper (Kwon et al., SOSP 2023) reports that serving systems which reserve contiguous KV
memory per request keep only 20.4-38.2 % of it in actual token states, against 96.3 % for vLLM's
paged allocator. This script replays synthetic ShareGPT-like and Alpaca-like traces (log-normal
lengths fitted to the published means; the real datasets are not shipped, see
reference/sim/traces.py) through the contiguous allocator with Orca's three reservation policies and
through the paged allocator, in the KV budget of OPT-13B on one A100-40GB (12 GiB, 15,728 token
slots), and prints:

1. Figure 2's table: % of KV memory in token states, reserved, internal and external
   fragmentation (+ free, which the paper's last bar lumps in as "others"), ours beside the
   paper's, averaged over the steps in which requests wait for memory;
2. the mean number of requests running at once in that budget, and the paged / Oracle and
   paged / Max ratios beside the paper's 2.2x and 4.3x;
3. a block-size sweep (1 to 256 tokens) of the paged allocator's internal fragmentation;
4. load sensitivity: the same allocators at lighter loads, averaged over every step, where an
   allocator that keeps up shows idle memory as "free" (one reason our "external + other"
   column can differ from the paper's, which does not say at which load it was measured).

    python benchmarks/memory_waste.py                   # about 25 s on one CPU core
    python benchmarks/memory_waste.py --quick --json /tmp/waste.json

No model runs: the simulator does only the allocator's bookkeeping (reference/sim/simulator.py).
"""

import argparse
import sys
import time
from pathlib import Path

from pagedllm.benchmarks.bench_report import write_json
from pagedllm.benchmarks.progress import progress
from pagedllm.reference.kv_size import GIB, kv_size
from pagedllm.reference.sim.simulator import simulate
from pagedllm.reference.sim.traces import WORKLOADS, synthetic_trace

# The paper's Figure 2 (values read off the figure's labels: approximate), in % of KV memory.
PAPER_FIGURE2 = {
    "max": {"token_states": 20.4, "reserved": 13.3, "internal": 57.3, "external_and_other": 8.9},
    "pow2": {"token_states": 26.8, "reserved": 17.9, "internal": 13.6, "external_and_other": 41.6},
    "oracle": {"token_states": 38.2, "reserved": 25.2, "internal": None,
               "external_and_other": 36.6},
    "paged": {"token_states": 96.3, "reserved": None, "internal": None,
              "external_and_other": None},
}
PAPER_BATCH_RATIO = {"oracle": 2.2, "max": 4.3}  # paged batches this many times more requests
LABELS = {"max": "Orca (Max)", "pow2": "Orca (Pow2)", "oracle": "Orca (Oracle)",
          "paged": "vLLM (paged, 16)"}
ALLOCATORS = ("max", "pow2", "oracle", "paged")
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
COLUMNS = ("token_states", "reserved", "internal", "external_and_other")

# Requests and arrival rate (per decode step) of each trace: more load than even the paged
# allocator serves (about 0.1 ShareGPT-like or 3.5 Alpaca-like requests per step), so memory is
# the bottleneck for every allocator through almost the whole run.
TRACES = {  # name: (requests, requests in --quick, rate)
    "sharegpt": (3000, 600, 1.0),
    "alpaca": (10000, 2000, 20.0),
}
SENSITIVITY_RATES = (0.03, 0.05, 0.1)  # ShareGPT-like requests per step, lighter loads
SENSITIVITY_REQUESTS = (1500, 400)  # (full, --quick)


def kv_budget_slots(model: str = "opt-13b", kv_gib: float = 12.0) -> int:
    """Token slots in kv_gib of KV memory: 12 GiB / 819,200 B = 15,728 for OPT-13B (fp16)."""
    return int(kv_gib * GIB) // kv_size(model).bytes_per_token


def percent(result) -> dict[str, float]:
    shares = {name: 100 * share for name, share in result.shares.items()}
    shares["external_and_other"] = shares["external"] + shares["free"]  # the paper's last bar
    return {name: round(value, 2) for name, value in shares.items()}


def summary(result) -> dict:
    return {"percent": percent(result), "mean_running": round(result.mean_running, 2),
            "steps": result.steps, "measured_steps": result.measured_steps,
            "preemptions": result.preemptions, "finished": result.finished}


def run_trace(name: str, num_requests: int, rate: float, total_slots: int, max_len: int,
              seed: int) -> dict:
    trace = synthetic_trace(name, num_requests, rate, seed=seed, max_len=max_len)
    model = WORKLOADS[name]
    out = {"trace": {
        "num_requests": num_requests, "rate_per_step": rate, "seed": seed,
        "distribution": "log-normal (synthetic; the real dataset is not shipped)",
        "prompt_sigma": model.prompt_sigma, "output_sigma": model.output_sigma,
        "prompt_mean": round(sum(r.prompt_len for r in trace) / len(trace), 2),
        "output_mean": round(sum(r.output_len for r in trace) / len(trace), 2),
        "published_prompt_mean": model.prompt_mean,
        "published_output_mean": model.output_mean,
    }}
    out["figure2"] = {a: summary(simulate(trace, a, total_slots, max_len))
                      for a in progress(ALLOCATORS, f"{name}-like: allocators", unit="run")}
    running = {a: out["figure2"][a]["mean_running"] for a in ALLOCATORS}
    out["batch_ratio"] = {f"paged_over_{a}": round(running["paged"] / running[a], 2)
                          for a in ("oracle", "max")}
    out["block_sweep"] = {}
    for block_size in progress(BLOCK_SIZES, f"{name}-like: block sizes", unit="run"):
        result = simulate(trace, "paged", total_slots, max_len, block_size=block_size)
        out["block_sweep"][str(block_size)] = summary(result)
    return out


def run_sensitivity(total_slots: int, max_len: int, seed: int, num_requests: int) -> dict:
    out = {}
    for rate in progress(SENSITIVITY_RATES, "load sensitivity", unit="rate"):
        trace = synthetic_trace("sharegpt", num_requests, rate, seed=seed, max_len=max_len)
        out[str(rate)] = {a: summary(simulate(trace, a, total_slots, max_len, measure="all"))
                          for a in ALLOCATORS}
    return out


def fmt(value: float | None) -> str:
    return "    -" if value is None else f"{value:5.1f}"


def print_figure2(name: str, res: dict, total_slots: int) -> None:
    t = res["trace"]
    print(f"\n== {name}-like trace: {t['num_requests']} requests, Poisson {t['rate_per_step']} "
          f"per step; prompt mean {t['prompt_mean']:.1f} (published {t['published_prompt_mean']})"
          f", output mean {t['output_mean']:.1f} (published {t['published_output_mean']})")
    print(f"   % of {total_slots:,} KV slots, averaged over the steps in which requests wait\n")
    titles = ("token states", "reserved", "internal frag", "external + other")
    print(f"{'':18}" + "".join(f"{t:>20}" for t in titles) + f"{'running':>10}")
    print(f"{'':18}" + f"{'ours  paper':>20}" * len(COLUMNS) + f"{'(mean)':>10}")
    for a in ALLOCATORS:
        ours, paper = res["figure2"][a]["percent"], PAPER_FIGURE2[a]
        cells = "".join(f"{fmt(ours[c]) + '  ' + fmt(paper[c]):>20}" for c in COLUMNS)
        print(f"{LABELS[a]:18}{cells}{res['figure2'][a]['mean_running']:10.1f}")
    r = res["batch_ratio"]
    print(f"\n   requests running at once: paged / Oracle = {r['paged_over_oracle']:.2f}x "
          f"(paper {PAPER_BATCH_RATIO['oracle']}x), paged / Max = {r['paged_over_max']:.2f}x "
          f"(paper {PAPER_BATCH_RATIO['max']}x)")
    ext = {a: res["figure2"][a]["percent"]["external"] for a in ("max", "pow2", "oracle")}
    print("   of 'external + other', external fragmentation proper: "
          + ", ".join(f"{LABELS[a]} {v:.1f}" for a, v in ext.items()))


def print_sweep(name: str, res: dict) -> None:
    sweep = res["block_sweep"]
    print(f"\n   paged block-size sweep ({name}-like): % of KV slots")
    print(f"   {'block size':16}" + "".join(f"{b:>7}" for b in BLOCK_SIZES))
    for label, key in (("internal frag", "internal"), ("token states", "token_states")):
        print(f"   {label:16}" + "".join(f"{sweep[str(b)]['percent'][key]:7.1f}"
                                       for b in BLOCK_SIZES))
    print(f"   {'running (mean)':16}" + "".join(f"{sweep[str(b)]['mean_running']:7.1f}"
                                             for b in BLOCK_SIZES))


def print_sensitivity(sens: dict) -> None:
    print("\n== load sensitivity (sharegpt-like, every step until the last arrival counted):")
    print("   % token states / % external + other (free included), per arrival rate")
    print(f"   {'rate per step':16}" + "".join(f"{LABELS[a]:>20}" for a in ALLOCATORS))
    for rate, by_alloc in sens.items():
        cells = "".join(f"{p['token_states']:>13.1f} / {p['external_and_other']:4.1f}"
                        for p in (by_alloc[a]["percent"] for a in ALLOCATORS))
        print(f"   {rate:16}{cells}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=None, help="write all numbers here")
    parser.add_argument("--quick", action="store_true", help="smaller traces (a few seconds)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="opt-13b", help="prices a token's KV (kv_size preset)")
    parser.add_argument("--kv-gib", type=float, default=12.0,
                        help="KV memory budget in GiB (OPT-13B on an A100-40GB leaves about 12)")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    total_slots = kv_budget_slots(args.model, args.kv_gib)
    max_len = kv_size(args.model).max_len
    print(f"KV budget: {args.kv_gib:g} GiB / {kv_size(args.model).bytes_per_token:,} B per token "
          f"({args.model}) = {total_slots:,} token slots; max_len {max_len}")
    results = {"config": {"model": args.model, "kv_gib": args.kv_gib, "total_slots": total_slots,
                          "max_len": max_len, "seed": args.seed, "quick": args.quick,
                          "block_size": 16, "measured": "steps in which a request waits"},
               "paper": {"figure2": PAPER_FIGURE2, "batch_ratio": PAPER_BATCH_RATIO},
               "workloads": {}}
    for name, (full, quick, rate) in TRACES.items():
        res = run_trace(name, quick if args.quick else full, rate, total_slots, max_len,
                        args.seed)
        results["workloads"][name] = res
        print_figure2(name, res, total_slots)
        print_sweep(name, res)
    sens = run_sensitivity(total_slots, max_len, args.seed,
                           SENSITIVITY_REQUESTS[1 if args.quick else 0])
    results["load_sensitivity"] = sens
    print_sensitivity(sens)
    results["seconds"] = round(time.perf_counter() - start, 2)
    print(f"\n({results['seconds']:.1f} s)")
    write_json(results, args.json)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
