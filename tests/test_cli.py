"""The command line: the demo on the default model, generate on a given folder, clear errors."""

import os
import shutil
import subprocess
import sys
from pathlib import Path


def run_cli(*args, cache_dir: Path, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PAGEDLLM_CACHE": str(cache_dir)}
    return subprocess.run([sys.executable, "-m", "pagedllm", *args], capture_output=True,
                          text=True, env=env, check=check, timeout=300)


def test_demo_prints_tokens_and_both_speeds(tmp_path):
    out = run_cli("demo", "--max-tokens", "24", cache_dir=tmp_path).stdout
    assert "RANDOM weights" in out  # says plainly that the default model is untrained
    assert out.count("generated: ") == 3
    assert out.count("same tokens: yes") == 3
    assert "with KV cache:" in out and "without KV cache:" in out and "speed-up:" in out
    # written on first use into the cache folder, reused after
    assert (tmp_path / "models" / "random-llama-3m-v1" / "model.safetensors").is_file()


def test_generate_on_a_checkpoint_folder(checkpoints, tmp_path):
    res = run_cli("generate", "--model", str(checkpoints["qwen2"]), "--prompt", "hello",
                  "--max-tokens", "8", "--ignore-eos", cache_dir=tmp_path)
    assert "8 tokens in" in res.stderr
    ids = run_cli("generate", "--model", str(checkpoints["opt"]), "--prompt-ids", "5,6,7",
                  "--max-tokens", "5", "--cache", "none", "--ignore-eos", cache_dir=tmp_path)
    assert "5 tokens in" in ids.stderr and "cache=none" in ids.stderr


def test_bad_input_exits_with_a_message(tmp_path):
    res = run_cli("generate", "--model", str(tmp_path / "missing"), "--prompt", "x",
                  cache_dir=tmp_path, check=False)
    assert res.returncode == 2
    assert res.stderr.startswith("error: model folder") and "Traceback" not in res.stderr


def test_kv_size_subcommand_and_console_script(tmp_path):
    out = run_cli("kv-size", "opt-13b", cache_dir=tmp_path).stdout
    assert "819,200" in out
    script = shutil.which("pagedllm", path=str(Path(sys.executable).parent))
    assert script, "the console script `pagedllm` is not installed next to this python"
    res = subprocess.run([script, "kv-size", "llama-3-8b"], capture_output=True, text=True,
                         check=True)
    assert "131,072" in res.stdout
