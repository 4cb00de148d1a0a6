"""Lesson 15's figure: the HTTP server under Poisson load, two settings of --max-num-seqs.

Runs ``benchmarks/serving_load.py --quick`` twice, each time starting its own server on
loopback: once with the defaults (``--max-num-seqs 256``: every request that fits in memory
runs at once) and once with ``--max-num-seqs 4`` (a small batch). Plots output throughput and
time to first token against the arrival rate.

    .venv/bin/python lessons/figures/serving_load.py          # about a minute and a half
    .venv/bin/python lessons/figures/serving_load.py --plot-only   # redraw from the JSON

It writes serving_load.json (both runs' rows), serving_load.png and its Korean edition
serving_load.ko.png (figlang.py) next to itself. Absolute
numbers depend on the machine (a 4-layer model on CPU cores); the shapes are the lesson.
"""

import argparse
import json
import tempfile
from pathlib import Path

import figlang

from pagedllm.benchmarks import serving_load

HERE = Path(__file__).resolve().parent

SETTINGS = {"--max-num-seqs 256 (default)": "", "--max-num-seqs 4": "--max-num-seqs 4"}


def measure() -> dict:
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, flags in SETTINGS.items():
            path = Path(tmp) / "load.json"
            serving_load.main(["--quick", "--server-args", flags, "--json", str(path)])
            runs[label] = json.loads(path.read_text())
    return runs


def plot(runs: dict, path: Path, lang: str = "en") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    T = figlang.chooser(lang)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for (label, run), marker in zip(runs.items(), "os", strict=False):
        rates = [r["rate"] for r in run["rows"]]
        label = T(label, label.replace("(default)", "(기본값)"))
        left.plot(rates, [r["output_tokens_per_s"] for r in run["rows"]], marker=marker,
                  label=label)
        right.plot(rates, [r["ttft_mean_s"] * 1000 for r in run["rows"]], marker=marker,
                   label=label)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel(T("arrival rate (requests/s, Poisson)", "도착률 (초당 요청, 포아송)"))
        ax.grid(alpha=0.3)
    right.set_yscale("log")
    left.set_ylabel(T("output tokens/s", "초당 출력 토큰"))
    right.set_ylabel(T("mean time to first token (ms)", "평균 첫 토큰까지의 시간 (ms)"))
    left.set_title(T("output throughput", "출력 처리량"))
    right.set_title(T("time to first token, queueing included",
                      "첫 토큰까지의 시간, 큐 대기 포함"))
    left.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plot-only", action="store_true")
    args = parser.parse_args()
    data = HERE / "serving_load.json"
    if not args.plot_only:
        data.write_text(json.dumps(measure(), indent=1) + "\n")
    for path in figlang.draw_both(plot, HERE / "serving_load.png", json.loads(data.read_text())):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
