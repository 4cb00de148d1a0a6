"""benchmarks/structured_outputs_step.py runs on the tiny model and reports every row (a short
run: two trials, two steps; the numbers themselves are the script's to print)."""

import math

from pagedllm.benchmarks.structured_outputs_step import measure
from pagedllm.serving.default_model import default_model_dir


def test_the_benchmark_reports_each_way_of_compiling():
    row = measure("optimized", default_model_dir(), batch=2, trials=2, steps=2)
    ways = ("step alone", "step, compile on the thread", "compile inline + step")
    for way in ways:
        for clock in ("wall_ms", "cpu_ms"):
            assert math.isfinite(row[f"{way}: {clock}"]) and row[f"{way}: {clock}"] > 0
    assert row["vocab"] == 4096 and row["first_structured_add_ms"] > 0
    assert row["decode, extra rows with a grammar: cpu_ms"] > 0
