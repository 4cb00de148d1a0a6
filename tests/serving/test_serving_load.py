"""The load script at a tiny size: it starts a server, runs a rate (or a closed loop of
clients), reports every column."""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serving_load.py"


def _script():
    """benchmarks/serving_load.py, loaded by its path as the command line runs it."""
    spec = importlib.util.spec_from_file_location("serving_load", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_serving_load_runs(tmp_path, capsys):
    module = _script()
    out = tmp_path / "load.json"
    # --max-seconds is a wall-clock cap (requests running at twice it are dropped): far past
    # what 6 requests need, so it guards a hang and never fails a slow machine.
    assert module.main(["--quick", "--rates", "16", "--num-requests", "6", "--max-seconds",
                        "300", "--json", str(out)]) == 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["completed"] == row["sent"] == 6 and row["failed"] == row["dropped"] == 0
    assert row["output_tokens_per_s"] > 0 and row["ttft_mean_s"] > 0
    assert row["normalized_latency_s_per_token"] > 0
    assert "| 16 req/s | 6/6 |" in capsys.readouterr().out


def test_serving_load_concurrency_mode(tmp_path, capsys):
    """aiperf's closed loop: 2 clients back to back, 4 requests of fixed lengths."""
    module = _script()
    out = tmp_path / "load.json"
    assert module.main(["--concurrency", "2", "--num-requests", "4", "--prompt-tokens", "8",
                        "--output-tokens", "5", "--json", str(out)]) == 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["concurrency"] == 2 and row["completed"] == row["sent"] == 4
    assert row["failed"] == row["dropped"] == 0
    assert row["output_tokens_per_s"] > 0 and row["itl_mean_s"] > 0
    assert "| concurrency 2 | 4/4 |" in capsys.readouterr().out
