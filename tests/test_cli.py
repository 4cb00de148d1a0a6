"""The command line: the demo on the default model, generate on a given folder, clear errors."""

import shutil
import subprocess
import sys
from pathlib import Path


def run_cli(*args, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedllm", *args], capture_output=True,
                          text=True, check=check, timeout=300)


def test_demo_prints_tokens_and_both_speeds():
    out = run_cli("demo", "--max-tokens", "24").stdout
    assert "trained on the documentation that ships with Python" in out
    assert out.count(" >>> ") == 3  # each prompt and its continuation
    assert "same tokens every way" in out
    assert "with KV cache:" in out and "without KV cache:" in out
    assert "engine, paged KV, 3 prompts batched:" in out and "speed-up of the KV cache:" in out


def test_generate_on_a_checkpoint_folder(checkpoints):
    res = run_cli("generate", "--model", str(checkpoints["qwen2"]), "--prompt", "hello",
                  "--prompt", "a longer second prompt", "--max-tokens", "8", "--ignore-eos")
    assert "16 tokens in" in res.stderr and "finish: length, length" in res.stderr
    ids = run_cli("generate", "--model", str(checkpoints["opt"]), "--prompt-ids", "5,6,7",
                  "--max-tokens", "5", "--kv-layout", "contiguous", "--ignore-eos")
    assert "5 tokens in" in ids.stderr and "kv_layout=contiguous" in ids.stderr


def test_bad_input_exits_with_a_message(tmp_path):
    res = run_cli("generate", "--model", str(tmp_path / "missing"), "--prompt", "x", check=False)
    assert res.returncode == 2
    assert res.stderr.startswith("error: model folder") and "Traceback" not in res.stderr


def test_kv_size_subcommand_and_console_script():
    out = run_cli("kv-size", "opt-13b").stdout
    assert "819,200" in out
    script = shutil.which("pagedllm", path=str(Path(sys.executable).parent))
    assert script, "the console script `pagedllm` is not installed next to this python"
    res = subprocess.run([script, "kv-size", "llama-3-8b"], capture_output=True, text=True,
                         check=True)
    assert "131,072" in res.stdout
