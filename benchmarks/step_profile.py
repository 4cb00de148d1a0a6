"""Where our engine's steps spend their time, measured from outside the engine.

Runs the throughput race's workload (``throughput_cpu.py``: the same checkpoint, requests and
batch size) through our paged + continuous engine, race system (a) without chunked prefill (so
that a step is a prefill or a decode), step by step, and splits the time by kind of step
(prefill, decode with a full batch, decode of the last requests once the queue is empty) and
by where it goes (the backend's ops: attention, the K/V store, the small ops, sampling; the rest
of the forward; the engine's bookkeeping before and after it), over the whole run and over a
window of steady-state decode steps. A few more steps then run under torch.profiler: its top
operators, and every operator's self time put in a group (matrix products, attention, small
ops, sampling, other), the grouping of lesson 14's figure (``lessons/figures/tier_profile.py``,
which uses this module's pieces).

Nothing in the engine is patched; everything goes through its public seams:

- a timing backend: each op of the ``Backend`` bundle (``pagedllm.reference.ops``) wrapped to
  add up its time and to label it for torch.profiler, ``dataclasses.replace(backend, op=...)``
  handed in as ``LLM(..., backend=...)``;
- a step observer (``engine.add_step_observer``), called just before the forward, and the
  sampler's call just after it: the step splits at these two points into the engine's work
  before the forward (scheduler, block moves, step inputs), the forward, and the work after
  the sampler (update, stop checks, outputs);
- ``engine.step()`` timed from outside, and ``llm.stats()`` between steps for the kind of step.

    python benchmarks/step_profile.py                    # the full workload, reference tier
    python benchmarks/step_profile.py --quick --tier optimized --json /tmp/profile.json
"""

import argparse
import functools
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from pagedllm.benchmarks import throughput_cpu as race
from pagedllm.benchmarks.bench_report import write_json
from pagedllm.benchmarks.progress import progress
from pagedllm.benchmarks.systems import BLOCK_SIZE
from pagedllm.optimized import CPU_BACKEND
from pagedllm.optimized import LLM as OptimizedLLM
from pagedllm.reference import LLM as ReferenceLLM
from pagedllm.reference import SamplingParams
from pagedllm.reference.ops import REFERENCE_BACKEND

TIERS = {"reference": (ReferenceLLM, REFERENCE_BACKEND),
         "optimized": (OptimizedLLM, CPU_BACKEND)}

# -- torch.profiler's operators, grouped ----------------------------------------------------------
# The backend's ops and the group of every torch operator they run.
LABELED = {"store_kv": "attention", "paged_attention": "attention", "rms_norm": "small ops",
           "rotary": "small ops", "silu_and_mul": "small ops", "sample": "sampling"}
GROUPS = ("matrix products", "attention", "small ops", "sampling", "other")
MATMULS = {"aten::mm", "aten::addmm", "aten::bmm"}
STEP = "engine step"  # the label around each profiled step


def labeled(backend):
    """The backend with each op run inside a record_function named after it."""
    def wrap(name, fn):
        @functools.wraps(fn)  # a swapped-in op: the runner calls it as it is
        def op(*args, **kwargs):
            with record_function(name):
                return fn(*args, **kwargs)
        return op
    return replace(backend, **{name: wrap(name, getattr(backend, name)) for name in LABELED})


def profile_steps(step, steps: int):
    """torch.profiler over `steps` calls of step() (an engine's step), each inside a STEP
    label."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with record_function(STEP):
                step()
    return prof


def group_of(event) -> str:
    """The group of one operator: its nearest labeled backend op, else by its name."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in LABELED:
            return LABELED[parent.name]
        parent = parent.cpu_parent
    return "matrix products" if event.name in MATMULS else "small ops"


def grouped(prof, steps: int = 1) -> dict:
    """Profiled steps (of a backend that is labeled()): ms per step by group, "other" being the
    step's time outside any torch operator; and operator calls per step (all, the outermost
    ones, and the weight products)."""
    ms = dict.fromkeys(GROUPS, 0.0)
    step_total, calls, outermost, products = 0.0, 0, 0, 0
    for event in prof.events():
        if event.name == STEP:
            step_total += event.cpu_time_total
        elif event.name not in LABELED:  # a torch operator
            group = group_of(event)
            ms[group] += event.self_cpu_time_total
            calls += 1
            products += group == "matrix products"
            parent = event.cpu_parent
            outermost += parent is None or parent.name in LABELED or parent.name == STEP
    ms["other"] = step_total - sum(ms.values())
    return {"ms_per_step": {g: v / 1000 / steps for g, v in ms.items()},
            "profiled_step_ms": step_total / 1000 / steps,
            "operator_calls_per_step": calls // steps,
            "outermost_operator_calls_per_step": outermost // steps,
            "matrix_product_calls": products // steps}


# -- wall time of the step's parts ----------------------------------------------------------------
class StepTimer:
    """Times engine steps from outside and splits each at the step observer (just before the
    forward) and at the sampler (just after it). `seconds` adds up, over the steps timed by
    step(): "step", "before" (scheduler, block moves, step inputs), "forward", "after" (update,
    stop checks, outputs), and each backend op, inclusive; `calls` counts them."""

    def __init__(self, backend):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.backend = replace(backend, **{name: self._timed(name, getattr(backend, name))
                                           for name in LABELED})
        self._spans: dict[str, tuple[float, float]] = {}  # op: (first start, last end)
        self._forward_began: float | None = None
        self.inputs = None  # the last step's StepInputs

    def _timed(self, name: str, fn):
        @functools.wraps(fn)  # a swapped-in op: the runner calls it as it is
        def op(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                end = time.perf_counter()
                self.seconds[name] += end - start
                self.calls[name] += 1
                self._spans[name] = (self._spans.get(name, (start,))[0], end)
        return op

    def observe(self, engine, scheduler_output, step_inputs) -> None:
        """The step observer: hand it to engine.add_step_observer. Keeps the step's inputs
        (`inputs`: a decode step's context lengths, say)."""
        self._forward_began = time.perf_counter()
        self.inputs = step_inputs

    def step(self, engine) -> list:
        """engine.step(), timed; its outputs."""
        self._spans.clear()
        self._forward_began = None
        start = time.perf_counter()
        outputs = engine.step()
        end = time.perf_counter()
        s, sample = self.seconds, self._spans.get("sample")
        s["step"] += end - start
        if self._forward_began is None or sample is None:  # nothing ran: bookkeeping only
            s["before"] += end - start
        else:
            s["before"] += self._forward_began - start
            s["forward"] += sample[0] - self._forward_began
            s["after"] += end - sample[1]
        self.calls["step"] += 1
        return outputs


def breakdown(seconds: dict, steps: int = 1, scale: float = 1000.0) -> list[tuple[str, float]]:
    """Exclusive shares of the step time (ms per step by default) from StepTimer's seconds."""
    s = seconds
    small = s["rms_norm"] + s["rotary"] + s["silu_and_mul"]
    rows = [
        ("forward: paged attention (gather blocks + attention)", s["paged_attention"]),
        ("forward: K/V store by slot mapping (one write per layer)", s["store_kv"]),
        ("forward: small ops (RMSNorm + residual, rotary, SiLU-and-mul)", small),
        ("forward: the rest (matrix products, embedding, views)",
         s["forward"] - s["paged_attention"] - s["store_kv"] - small),
        ("sampling (the batched sampler)", s["sample"]),
        ("engine before the forward: scheduler, block moves, inputs", s["before"]),
        ("engine after the sampler: update, stop checks, outputs", s["after"]),
    ]
    return [(name, scale * sec / steps) for name, sec in rows]


def print_breakdown(rows: list[tuple[str, float]], total: float, unit: str) -> None:
    for name, value in rows:
        print(f"  {name:62}{value:9.2f} {unit:3}{100 * value / total:6.1f} %")


# -- the run --------------------------------------------------------------------------------------
def run_profile(ckpt: Path, work, batch: int, max_len: int, tier: str = "reference",
                steps: int = 12, profiled_steps: int = 4) -> dict:
    """Run the whole workload step by step with the timers on; split the run, and a window of
    `steps` steady-state decode steps (a full batch decoding), by where the time goes; then
    profile `profiled_steps` more with torch.profiler."""
    llm_class, backend = TIERS[tier]
    timer = StepTimer(labeled(backend))
    # The race's (a) without chunked prefill: a step is then a prefill or a decode, not both
    llm = llm_class(ckpt, kv_layout="paged", batching="continuous", max_num_seqs=batch,
                    max_model_len=max_len, block_size=BLOCK_SIZE,
                    num_gpu_blocks=batch * max_len // BLOCK_SIZE, backend=timer.backend)
    engine = llm.engine
    engine.add_step_observer(timer.observe)
    for i, (ids, n) in enumerate(work):  # as the race runs them: outputs when requests finish
        engine.add_request(str(i), {"prompt_token_ids": ids}, SamplingParams(
            temperature=0.0, max_tokens=n, ignore_eos=True, output_kind="final_only"))
    kinds = {"prefill": [0, 0.0], "decode, full batch": [0, 0.0],
             "decode, part batch (queue empty)": [0, 0.0]}
    part_seqs, full_run, window, contexts, prof = 0, 0, None, [], None
    stats = llm.stats()
    bar = progress(None, f"profile of (a), {tier} tier", total=len(work), unit="request")
    while engine.has_unfinished_requests():
        if window is None and full_run >= 3 and stats["running"] == batch:
            before = dict(timer.seconds), dict(timer.calls)
            for n in range(steps):
                timer.step(engine)
                if n == 0:
                    contexts = timer.inputs.attn_metadata.seq_lens_cpu.tolist()
            window = ({k: v - before[0].get(k, 0.0) for k, v in timer.seconds.items()},
                      {k: (v - before[1].get(k, 0)) // steps for k, v in timer.calls.items()})
            prof = profile_steps(lambda: timer.step(engine), profiled_steps)
            full_run, stats = 0, llm.stats()
        began = time.perf_counter()
        timer.step(engine)
        seconds = time.perf_counter() - began
        after = llm.stats()
        decoded = after["decode_tokens"] - stats["decode_tokens"]
        if after["prefill_tokens"] > stats["prefill_tokens"]:
            kind, full_run = "prefill", 0
        elif decoded == batch:
            kind, full_run = "decode, full batch", full_run + 1
        else:
            kind, full_run = "decode, part batch (queue empty)", 0
            part_seqs += decoded
        kinds[kind][0] += 1
        kinds[kind][1] += seconds
        stats = after
        unfinished = sum(stats.get(k, 0) for k in ("running", "waiting", "swapped"))
        bar.update(len(work) - unfinished - bar.n)
    bar.close()
    whole = dict(timer.seconds)
    total = whole["step"]
    print(f"\n== profile of (a), the {tier} tier, {torch.get_num_threads()} threads: the whole "
          f"workload, {total:.1f} s in steps (timers on)")
    for kind, (count, sec) in kinds.items():
        extra = (f", {part_seqs / count:.1f} sequences on average"
                 if kind.startswith("decode, part") and count else "")
        print(f"  {kind:34}{count:6d} steps {sec:7.1f} s {100 * sec / total:5.1f} %"
              f"{'' if not count else f'  {1000 * sec / count:6.1f} ms/step'}{extra}")
    run_rows = breakdown(defaultdict(float, whole), scale=1.0)
    print("  where the whole run's time goes:")
    print_breakdown(run_rows, total, "s")
    result = {"tier": tier, "threads": torch.get_num_threads(), "run_seconds_in_steps": total,
              "steps_by_kind": {k: {"steps": c, "seconds": s} for k, (c, s) in kinds.items()},
              "run_breakdown_seconds": dict(run_rows)}
    if window is None:
        print("  (the batch never ran full: no steady-state window)")
        return result
    seconds, calls = window
    step_ms = 1000 * seconds["step"] / steps
    rows = breakdown(defaultdict(float, seconds), steps)
    print(f"\n  {steps} steady-state decode steps ({batch} sequences, context lengths "
          f"{min(contexts)}-{max(contexts)}, mean {sum(contexts) / len(contexts):.0f}): "
          f"{step_ms:.1f} ms per step")
    print_breakdown(rows, step_ms, "ms")
    keys = ("paged_attention", "store_kv", "rms_norm", "sample")
    print("  calls per step: " + ", ".join(f"{k} {calls.get(k, 0)}" for k in keys))
    result.update({"steady_steps": steps, "steady_ms_per_step": step_ms,
                   "steady_context_lengths": [min(contexts), max(contexts)],
                   "steady_breakdown_ms_per_step": dict(rows),
                   "steady_calls_per_step": {k: calls.get(k, 0) for k in keys}})
    result.update(print_profiled(prof, profiled_steps))
    return result


def print_profiled(prof, steps: int) -> dict:
    """torch.profiler's view of `steps` steps: operators by group, and the top operators."""
    groups = grouped(prof, steps)
    print(f"\n  torch.profiler, the next {steps} steps: "
          f"{groups['profiled_step_ms']:.1f} ms per step profiled, by group of operators:")
    for g, ms in groups["ms_per_step"].items():
        print(f"  {g:62}{ms:9.2f} ms {100 * ms / groups['profiled_step_ms']:6.1f} %")
    print(f"  matrix product calls per step: {groups['matrix_product_calls']}; outermost "
          f"operators per step: {groups['outermost_operator_calls_per_step']}")
    averages = prof.key_averages()
    ops = sorted((e for e in averages if e.key not in LABELED and e.key != STEP),
                 key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
    total_us = sum(e.self_cpu_time_total for e in averages)
    print("\n  top operators by self CPU time:")
    print(f"  {'operator':34}{'calls/step':>11}{'ms/step':>9}{'share':>8}")
    top = []
    for e in ops:
        top.append({"op": e.key, "calls_per_step": e.count / steps,
                    "ms_per_step": e.self_cpu_time_total / 1000 / steps,
                    "share": e.self_cpu_time_total / total_us})
        print(f"  {e.key[:34]:34}{e.count / steps:11.0f}"
              f"{e.self_cpu_time_total / 1000 / steps:9.2f}"
              f"{100 * e.self_cpu_time_total / total_us:7.1f}%")
    ops_per_step = sum(e.count for e in averages
                       if e.key not in LABELED and e.key != STEP) / steps
    print(f"  operators dispatched per step: {ops_per_step:.0f}")
    return {"torch_profiler_groups": groups, "torch_profiler_top": top,
            "ops_per_step": ops_per_step}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the race's small size")
    parser.add_argument("--model", default=None,
                        help="a real checkpoint instead of random weights (as the race's)")
    parser.add_argument("--tier", choices=tuple(TIERS), default="reference")
    parser.add_argument("--steps", type=int, default=12, help="steady-state steps timed")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1; 0: torch's default)")
    parser.add_argument("--json", type=Path, default=None, help="write all numbers here")
    args = parser.parse_args(argv)
    size = "model" if args.model else "quick" if args.quick else "full"
    began = time.perf_counter()
    torch.manual_seed(race.SEED)
    with race.torch_threads(args.threads), \
            tempfile.TemporaryDirectory(prefix="pagedllm-step-profile-") as tmp:
        ckpt, work, config = race.prepare(Path(tmp), size, args.model)
        result = run_profile(ckpt, work, config["batch_size"],
                             config["workload"]["max_model_len"], args.tier, args.steps)
    results = {"config": config, "profile": result, "run_seconds": time.perf_counter() - began}
    print(f"\ntotal run time {results['run_seconds']:.0f} s")
    write_json(results, args.json)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
