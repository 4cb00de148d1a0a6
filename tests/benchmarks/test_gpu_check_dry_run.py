"""benchmarks/gpu_check.py, the script a lent GPU runs, walked on the CPU: --dry-run runs every
section (the GPU tests, all skipped here; the kernel benchmark's dry run; the engines and
transformers on tiny shapes of the three model configs; the decode probe) and ends with its
table. A script that only runs where a GPU is must not first fail there on a typo."""

import json
import os
import site
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def test_gpu_check_dry_run(tmp_path):
    report = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--json", str(report)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    lines = done.stdout.rstrip().splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["section", "item"])
    table = lines[header:]  # the table is the last thing printed
    assert table[-1] == "gpu_check: 0 section(s) failed; exit 0", out
    rows = table[2:-2]
    assert all("FAILED" not in row for row in rows), out
    sections = {row.split()[0] for row in rows}
    assert sections == {"compile", "tests", "kernels", "e2e", "decode", "parallel"}, out
    # tensor_parallel_size 1 and 2 over gloo (a GPU run takes NCCL, with two GPUs or more)
    assert sum(row.startswith("parallel") and "tensor_parallel_size" in row
               for row in rows) == 2, out
    for model in ("smollm2-135m", "qwen2.5-0.5b", "llama-3.2-1b"):
        assert any(row.split()[1] == f"{model}:" for row in rows), out
    for system in ("optimized engine", "optimized engine, int8 weights",
                   "optimized engine, int4 weights", "reference engine", "transformers generate",
                   "transformers gen_batch"):
        assert sum(f"{system} " in row for row in rows) == 3, out  # once per model
    data = json.loads(report.read_text())
    assert data["failures"] == [] and data["mode"] == "dry"
    assert data["sections"]["compile"]["exit"] == 0 and data["sections"]["compile"]["summary"]
    llama = data["sections"]["e2e llama-3.2-1b"]["systems"]
    # Greedy on the same bfloat16 checkpoint: transformers' tokens are the optimized engine's.
    assert llama["hf_generate"]["agreement_with_optimized"]["identical"] == 6
    assert llama["reference"]["partial"]  # the dry run walks the time-limit path too
    assert report.with_suffix(".log").exists()


def test_gpu_check_imports_a_plain_checkout(tmp_path):
    """No installed pagedllm (python -S: no site, so no editable install's finder), only the
    checkout on PYTHONPATH: pagedllm.<tier> and the benchmarks resolve to its folders."""
    packages = os.pathsep.join([str(ROOT), *site.getsitepackages()])
    code = ("import pagedllm.benchmarks.gpu_check, pagedllm.optimized, "
            "pagedllm.reference.engine.llm as m; print(m.__file__)")
    done = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env={**os.environ, "PYTHONPATH": packages})
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == ROOT / "reference" / "engine" / "llm.py"
