"""The weight layout of a few-row product on a CPU: nn.Linear's [out, in] against [in, out].

Lesson 14's measurement behind ``optimized/layers.py``'s TransposedLinear. The weights are a
model's (by default the shipped tiny model's 17 products of one decode step: 4 layers of
merged QKV, o_proj, merged gate/up and down_proj, and the LM head), multiplied one after the
other as a forward does, so that each weight comes from memory rather than from a warm cache.
One torch thread, this thread's CPU time, the median of --repeats runs (min-max beside it).

    python benchmarks/linear_layout.py
    python benchmarks/linear_layout.py --rows 1,2,3,4,8,16 --repeats 7
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from pagedllm.optimized.layers import merge_projections
from pagedllm.reference.model.loader import load_model
from pagedllm.serving.default_model import default_model_dir


def step_weights(model_dir) -> list[torch.Tensor]:
    """The [out, in] weights of one decode step's products, in the forward's order."""
    model = merge_projections(load_model(model_dir))
    return [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)]


def seconds(fn, calls: int, repeats: int) -> list[float]:
    fn()  # warm-up
    runs = []
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(calls):
            fn()
        runs.append((time.thread_time() - start) / calls)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a model folder (default: the tiny model)")
    ap.add_argument("--rows", default="1,3,16", help="comma-separated rows per product")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls", type=int, default=100, help="forwards' products per run")
    args = ap.parse_args()
    torch.set_num_threads(1)
    weights = step_weights(args.model or default_model_dir())  # [out, in] each
    transposed = [w.t().contiguous() for w in weights]  # [in, out] each
    print(f"{len(weights)} products per step, {sum(w.numel() for w in weights) * 4 / 2**20:.1f}"
          f" MiB of float32 weights; ms per step's products, median (min-max) of "
          f"{args.repeats}")
    print(f"{'rows':>4}  {'nn.Linear [out, in]':>22}  {'[in, out]':>22}  speed-up")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(rows, w.shape[1]) for w in weights]
        linear = seconds(lambda xs=xs: [F.linear(x, w) for x, w in zip(xs, weights, strict=True)],
                         args.calls, args.repeats)
        layout = seconds(lambda xs=xs: [x @ wt for x, wt in zip(xs, transposed, strict=True)],
                         args.calls, args.repeats)

        def cell(runs):
            return (f"{statistics.median(runs) * 1e3:6.2f} ({min(runs) * 1e3:.2f}-"
                    f"{max(runs) * 1e3:.2f})")

        ratio = statistics.median(linear) / statistics.median(layout)
        print(f"{rows:>4}  {cell(linear):>22}  {cell(layout):>22}  {ratio:7.2f}x")


if __name__ == "__main__":
    main()
