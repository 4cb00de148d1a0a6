"""benchmarks/kernels_gpu.py --dry-run: every path of the GPU benchmark runs on the CPU (tiny
sizes, kernels through Triton's interpreter, paged attention checked against SDPA), no timing."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_kernels_gpu_dry_run(tmp_path):
    report = tmp_path / "kernels_gpu.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernels_gpu.py"),
                           "--dry-run", "--json", str(report)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "section   case" in done.stdout
    assert report.exists()
