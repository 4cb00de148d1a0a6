"""Decode speed with and without a KV cache, measured on the default model (lesson 1's figure).

For each total length (prompt + generated tokens) the script generates greedily with
``generate`` (pagedllm.reference.engine.generate), once with ``cache="contiguous"`` (the prompt
once, then one token per step) and once with ``cache="none"`` (the whole sequence again at every
step). It checks that both produce the same tokens and times them. It also times every model call
of the longest runs, so the figure shows both the cost of one step as the sequence grows and the
resulting throughput.

    .venv/bin/python lessons/figures/decode_speed.py            # about a minute on 2 CPU cores
    .venv/bin/python lessons/figures/decode_speed.py --totals 64 128 --repeats 1   # quick look
    .venv/bin/python lessons/figures/decode_speed.py --plot-only   # redraw from the .json

It writes decode_speed.json (the numbers), decode_speed.png and its Korean edition
decode_speed.ko.png (figlang.py) next to itself, and prints a table.
Compare the two caches by their ratio, measured side by side in one run: absolute times depend
on the machine. Three choices keep the result from depending on whatever else the machine runs:
one PyTorch thread (with two threads on two busy cores, single steps ran a hundred times
slower); the process's CPU time as the clock (time spent waiting for a core is not counted; on an
idle machine it equals wall time with one thread; ``--clock wall`` measures wall time); and the
fastest of several runs for each point.
"""

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import figlang
import torch

from pagedllm.reference import generate, load_model
from pagedllm.serving.default_model import default_model_dir

HERE = Path(__file__).resolve().parent
PROMPT_TOKENS = 16  # the prompt: the first 16 tokens of PROMPT_TEXT
PROMPT_TEXT = ("The KV cache stores the keys and values of every token that came before, so "
               "that each new token is computed once and only once.")
CACHES = ("contiguous", "none")
SMOOTH = 9  # steps in the running median of the per-step plot


def count_parameters(model: torch.nn.Module) -> int:
    """Parameters, counting a tied input/output embedding once."""
    unique = {p.data_ptr(): p.numel() for p in model.parameters()}
    return sum(unique.values())


def prompt_for(model_dir: Path, vocab_size: int) -> list[int]:
    """PROMPT_TOKENS ids: PROMPT_TEXT through the checkpoint's tokenizer, or plain ids without one.

    Only the number of tokens matters for the timing; real text just makes the run realistic.
    """
    if any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(model_dir)(PROMPT_TEXT)["input_ids"]
        if len(ids) >= PROMPT_TOKENS:
            return ids[:PROMPT_TOKENS]
    return [(7 * i + 3) % vocab_size for i in range(PROMPT_TOKENS)]


class StepTimer:
    """Times every forward call of a model and notes the sequence length it reached."""

    def __init__(self, model: torch.nn.Module, clock):
        self.clock = clock
        self.records: list[tuple[int, float]] = []  # (sequence length after the call, seconds)
        self._start = 0.0
        self._handles = [model.register_forward_pre_hook(self._pre),
                         model.register_forward_hook(self._post)]

    def _pre(self, module, args):
        self._start = self.clock()

    def _post(self, module, args, output):
        positions = args[1]  # forward(token_ids, positions, cache, last_only=...)
        self.records.append((int(positions[-1]) + 1, self.clock() - self._start))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def measure(model, prompt_ids: list[int], totals: list[int], repeats: dict[str, int],
            clock=time.process_time) -> dict:
    longest = max(totals)
    runs: dict[int, dict] = {}
    per_step: dict[str, dict[int, float]] = {cache: {} for cache in CACHES}
    for cache in CACHES:  # warm-up, not timed: first calls pay for allocations and dispatch
        for _ in range(3):
            generate(model, prompt_ids, 48, cache=cache)
    for total in totals:
        new_tokens = total - len(prompt_ids)
        row, outputs = {}, {}
        for cache in CACHES:
            best = float("inf")
            for _ in range(repeats[cache]):  # the fastest run is the least disturbed one
                timer = StepTimer(model, clock) if total == longest else None
                start = clock()
                outputs[cache] = generate(model, prompt_ids, new_tokens, cache=cache)
                best = min(best, clock() - start)
                if timer is not None:
                    timer.remove()
                    for length, seconds in timer.records:
                        old = per_step[cache].get(length, float("inf"))
                        per_step[cache][length] = min(old, seconds)
            row[cache] = {"new_tokens": len(outputs[cache]), "seconds": best,
                          "tokens_per_s": len(outputs[cache]) / best,
                          "ms_per_token": 1000 * best / len(outputs[cache])}
        if outputs["contiguous"] != outputs["none"]:
            raise SystemExit(f"cached and uncached generation disagree at total {total}")
        row["speedup"] = row["contiguous"]["tokens_per_s"] / row["none"]["tokens_per_s"]
        runs[total] = row
    decode_lengths = sorted(n for n in per_step["none"] if n > len(prompt_ids))
    return {
        "runs": {str(total): row for total, row in runs.items()},
        "per_step_ms": {  # decode steps only; the prefill call (length = prompt) is left out
            "seq_len": decode_lengths,
            **{cache: [round(1000 * per_step[cache][n], 4) for n in decode_lengths]
               for cache in CACHES},
        },
    }


def running_median(values: list[float], window: int) -> list[float]:
    """Each value replaced by the median of the `window` values around it (spikes removed)."""
    half = window // 2
    return [statistics.median(values[max(0, i - half):i + half + 1]) for i in range(len(values))]


def plot(result: dict, path: Path, lang: str = "en") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    T = figlang.chooser(lang)
    colors = {"contiguous": "#1f77b4", "none": "#d62728"}
    labels = {"contiguous": T("with KV cache", "KV 캐시 있음"),
              "none": T("without KV cache", "KV 캐시 없음")}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))

    steps = result["per_step_ms"]
    for cache in CACHES:
        left.plot(steps["seq_len"], running_median(steps[cache], SMOOTH), color=colors[cache],
                  lw=1.5, label=labels[cache])
    left.set_xlabel(T("sequence length reached (tokens)", "도달한 시퀀스 길이 (토큰)"))
    left.set_ylabel(T(f"ms per decode step (running median of {SMOOTH})",
                      f"디코드 스텝당 ms ({SMOOTH}개 이동 중앙값)"))
    left.set_title(T("Cost of one decode step", "디코드 스텝 하나의 비용"))
    left.set_ylim(bottom=0)
    left.grid(alpha=0.3)
    left.legend(loc="upper left")

    totals = list(result["runs"])
    x = range(len(totals))
    width = 0.38
    for i, cache in enumerate(CACHES):
        speeds = [result["runs"][t][cache]["tokens_per_s"] for t in totals]
        offset = [p + (i - 0.5) * width for p in x]
        bars = right.bar(offset, speeds, width, color=colors[cache])
        right.bar_label(bars, fmt="%.0f", fontsize=8, padding=2)
    for p, t in zip(x, totals, strict=True):
        top = result["runs"][t]["contiguous"]["tokens_per_s"]
        right.text(p, top * 1.12, f"{result['runs'][t]['speedup']:.1f}x", ha="center",
                   fontsize=9, fontweight="bold")
    right.set_xticks(list(x), [f"{t}" for t in totals])
    right.set_xlabel(T(f"total tokens generated to (prompt of {result['prompt_tokens']})",
                       f"생성을 마친 전체 토큰 수 (프롬프트 {result['prompt_tokens']})"))
    right.set_ylabel(T("generated tokens per second", "초당 생성 토큰"))
    right.set_title(T("Average speed of a whole generation (bold: speed-up)",
                      "생성 전체의 평균 속도 (굵은 글씨: 속도 향상)"))
    right.set_ylim(0, max(r["contiguous"]["tokens_per_s"] for r in result["runs"].values()) * 1.3)
    right.grid(axis="y", alpha=0.3)  # no legend: the colours are the left panel's

    m = result["machine"]
    threads = f"{m['torch_threads']} torch thread{'s' if m['torch_threads'] > 1 else ''}"
    params = f"{result['config']['parameters'] / 1e6:.1f}M"
    clock = {"process CPU time": "프로세스 CPU 시간", "wall time": "벽시계 시간"}
    fig.suptitle(T(f"{result['model']} ({params} parameters), reference tier, {result['dtype']}, "
                   f"{threads} on a {m['cpu_count']}-core CPU, clock: {result['clock']}",
                   f"{result['model']} (파라미터 {params}), 레퍼런스 계층, {result['dtype']}, "
                   f"{m['cpu_count']}코어 CPU에서 torch 스레드 {m['torch_threads']}개, "
                   f"시계: {clock.get(result['clock'], result['clock'])}"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_table(result: dict) -> None:
    print(f"{'total':>6} {'new':>5} | {'cache tok/s':>11} {'ms/tok':>7} | "
          f"{'no cache tok/s':>14} {'ms/tok':>7} | {'speed-up':>8}")
    for total, row in result["runs"].items():
        c, n = row["contiguous"], row["none"]
        print(f"{total:>6} {c['new_tokens']:>5} | {c['tokens_per_s']:>11.1f} "
              f"{c['ms_per_token']:>7.2f} | {n['tokens_per_s']:>14.1f} {n['ms_per_token']:>7.2f} | "
              f"{row['speedup']:>7.1f}x")
    steps = result["per_step_ms"]
    cached, plain = (running_median(steps[cache], SMOOTH) for cache in CACHES)
    print(f"one decode step at length {steps['seq_len'][0]} / {steps['seq_len'][-1]} (running "
          f"median of {SMOOTH}): with cache {cached[0]:.2f} / {cached[-1]:.2f} ms, "
          f"without {plain[0]:.2f} / {plain[-1]:.2f} ms")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--totals", type=int, nargs="+", default=[64, 128, 256, 512],
                        help="sequence lengths (prompt + generated) to generate to")
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs per point without a cache; the fastest counts")
    parser.add_argument("--cached-repeats", type=int, default=6,
                        help="runs per point with the cache (they are cheap, and short runs "
                        "are the most disturbed by other work on the machine)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--clock", choices=list(CLOCKS), default="cpu",
                        help="cpu: the process's CPU time (default); wall: elapsed time")
    parser.add_argument("--model", type=Path, default=None,
                        help="checkpoint folder (default: the model pagedllm ships with)")
    parser.add_argument("--out", type=Path, default=HERE, help="folder for the .json and .png")
    parser.add_argument("--plot-only", action="store_true",
                        help="redraw both editions from the .json in --out, measuring nothing")
    args = parser.parse_args(argv)
    if args.plot_only:
        result = json.loads((args.out / "decode_speed.json").read_text())
        for path in figlang.draw_both(plot, args.out / "decode_speed.png", result):
            print(f"wrote {path}")
        return 0

    torch.set_num_threads(args.threads)
    if min(args.totals) <= PROMPT_TOKENS:
        parser.error(f"every total must exceed the prompt's {PROMPT_TOKENS} tokens")
    repeats = {"contiguous": args.cached_repeats, "none": args.repeats}
    model_dir = args.model or default_model_dir()
    model = load_model(model_dir)
    cfg = model.config
    if max(args.totals) > cfg.max_position_embeddings:
        parser.error(f"the model has {cfg.max_position_embeddings} positions; "
                     f"--totals must not exceed that")
    prompt_ids = prompt_for(model_dir, cfg.vocab_size)
    started = time.perf_counter()
    result = {
        "model": model_dir.name,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "config": {"layers": cfg.num_layers, "hidden": cfg.hidden_size, "heads": cfg.num_heads,
                   "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
                   "parameters": count_parameters(model)},
        "prompt_tokens": len(prompt_ids),
        "machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "torch": torch.__version__, "python": platform.python_version(),
                    "processor": platform.processor() or platform.machine()},
        "clock": {"cpu": "process CPU time", "wall": "wall time"}[args.clock],
        "repeats": {"contiguous": args.cached_repeats, "none": args.repeats},
        **measure(model, prompt_ids, sorted(args.totals), repeats, CLOCKS[args.clock]),
    }
    result["measure_seconds"] = round(time.perf_counter() - started, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_speed.json").write_text(json.dumps(result, indent=1) + "\n")
    figlang.draw_both(plot, args.out / "decode_speed.png", result)
    print_table(result)
    print(f"measured in {result['measure_seconds']} s; wrote {args.out / 'decode_speed.json'} "
          f"and {args.out / 'decode_speed.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
