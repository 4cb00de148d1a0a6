"""The engine's own work per step, apart from the model: host time per decode step and per
running sequence, for 1, 16 and 256 sequences, in both tiers.

On a GPU a small model's forward takes less time than the Python around it, so this host work
is the whole step; on a CPU it is what makes batching lose on a tiny model. We measure it
through the model-runner seam: the engine runs a ``TimedRunner`` (the tier's own runner,
subclassed, timing ``execute`` and ``sample`` from outside) and a step observer marks the moment
the forward starts. One decode step of the engine then splits into

    schedule + prepare   step() starts -> observer (scheduling, block moves, StepInputs)
    model                runner.execute (the forward) + runner.sample (the sampler op)
    update               after sampling -> step() returns (append, detokenize, stops, outputs)

and the host work is the step minus the model. Every request decodes to its max_tokens
(EOS ignored), greedy, with max_num_seqs = the batch, so every timed step is a full-batch
decode step; the median over the timed steps is reported, one torch thread, in this thread's
CPU time (steadier than wall time on a shared machine; equal to it on an idle one). Requests
are final-only (``output_kind``), as ``LLM.generate`` makes them; ``--output-kind cumulative``
measures a server's requests, whose outputs are built every step.

    python benchmarks/step_overhead.py                 # 1, 16, 256 sequences, both tiers
    python benchmarks/step_overhead.py --seqs 16 --steps 20 --json /tmp/overhead.json
"""

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedllm import optimized, reference
from pagedllm.benchmarks.progress import progress
from pagedllm.serving.default_model import default_model_dir

# This thread's CPU time: with one torch thread the forward runs on it too, and on a machine
# shared with other jobs CPU time does not stretch while the thread waits for a core.
CLOCK = time.thread_time

TIERS = {"reference": (reference.EngineArgs, reference.ModelRunner),
         "optimized": (optimized.EngineArgs, optimized.ModelRunner)}


def timed_runner(base: type) -> type:
    """The tier's runner, with the seconds of each execute and sample recorded."""

    class TimedRunner(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.seconds: list[float] = []

        def execute(self, inputs):
            start = CLOCK()
            logits = super().execute(inputs)
            self.seconds.append(CLOCK() - start)
            return logits

        def sample(self, logits, sampling):
            start = CLOCK()
            out = super().sample(logits, sampling)
            self.seconds[-1] += CLOCK() - start
            return out

    TimedRunner.__name__ = f"Timed{base.__name__}"
    return TimedRunner


@dataclass
class StepTimes:
    step: float  # whole step() call
    prepare: float  # schedule + block moves + prepare_inputs
    model: float  # execute + sample

    @property
    def host(self) -> float:
        return self.step - self.model

    @property
    def update(self) -> float:
        return self.step - self.prepare - self.model


def measure(tier: str, num_seqs: int, steps: int, model_dir: Path, prompt_len: int = 16,
            warmup: int = 3, output_kind: str = "final_only") -> dict:
    args_class, runner = TIERS[tier]
    max_len = prompt_len + warmup + steps + 4
    llm = reference.LLM(args_class(
        model_dir, model_runner=timed_runner(runner), max_num_seqs=num_seqs,
        max_model_len=max_len, max_num_batched_tokens=max(2048, num_seqs * prompt_len),
        num_gpu_blocks=num_seqs * (-(-max_len // 16)) + 1))
    engine = llm.engine
    vocab = engine.vocab_size
    params = reference.SamplingParams(temperature=0.0, max_tokens=warmup + steps + 2,
                                      ignore_eos=True, output_kind=output_kind)
    for i in range(num_seqs):
        ids = [(7 * i + 3 * j) % (vocab - 1) + 1 for j in range(prompt_len)]
        engine.add_request(f"r{i}", {"prompt_token_ids": ids}, params)
    marks: list[float] = []
    engine.add_step_observer(lambda *_: marks.append(CLOCK()))
    engine.step()  # the prefill of every prompt
    times = []
    for n in range(warmup + steps):
        start = CLOCK()
        engine.step()
        end = CLOCK()
        if n >= warmup:
            times.append(StepTimes(end - start, marks[-1] - start, engine.runner.seconds[-1]))
    while engine.has_unfinished_requests():
        engine.step()

    def median(attr):
        return statistics.median(getattr(t, attr) for t in times) * 1e3  # ms

    host = median("host")
    return {"tier": tier, "seqs": num_seqs, "steps": steps, "step_ms": median("step"),
            "model_ms": median("model"), "host_ms": host, "prepare_ms": median("prepare"),
            "update_ms": median("update"), "host_us_per_seq": host * 1e3 / num_seqs}


def print_table(rows: list[dict]) -> None:
    print(f"{'tier':<10} {'seqs':>5} {'step ms':>9} {'model ms':>9} {'host ms':>9} "
          f"{'schedule+prepare':>17} {'update':>8} {'host µs/seq':>12}")
    for r in rows:
        print(f"{r['tier']:<10} {r['seqs']:>5} {r['step_ms']:>9.2f} {r['model_ms']:>9.2f} "
              f"{r['host_ms']:>9.2f} {r['prepare_ms']:>17.2f} {r['update_ms']:>8.2f} "
              f"{r['host_us_per_seq']:>12.1f}")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", default="1,16,256", help="batch sizes, comma-separated")
    parser.add_argument("--steps", type=int, default=30, help="timed decode steps per size")
    parser.add_argument("--tiers", default="reference,optimized")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output-kind", default="final_only",
                        choices=("final_only", "cumulative"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = default_model_dir()
    runs = [(int(n), tier) for n in args.seqs.split(",") for tier in args.tiers.split(",")]
    rows = [measure(tier, n, args.steps, model_dir, output_kind=args.output_kind)
            for n, tier in progress(runs, "sizes x tiers", unit="run")]
    print_table(rows)
    if args.json:
        import json

        args.json.write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
