"""The command line: the demo on the default model, generate on a given folder, clear errors."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest


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


def test_user_mistakes_are_one_error_line_not_a_traceback(checkpoints, tmp_path):
    """The real command, as a user runs it: exit 2, one line on stderr starting with `error:`.
    The processes run side by side: each spends its ~2 s importing torch."""
    corrupt = shutil.copytree(checkpoints["llama"], tmp_path / "corrupt")
    (corrupt / "config.json").write_text('{"model_type": "llama",')
    model = str(checkpoints["llama"])
    cases = {
        "model folder": ["generate", "--model", str(tmp_path / "missing"), "--prompt", "x"],
        "config.json is not valid JSON": ["generate", "--model", str(corrupt), "--prompt", "x"],
        "--temperature must be >= 0, got -1.0": ["generate", "--model", model, "--prompt", "x",
                                                 "--temperature", "-1"],
        "--tokens must be >= 1, got 0": ["kv-size", "opt-13b", "--tokens", "0"],
        "--memory-gib must be a finite number": ["kv-size", "opt-13b", "--memory-gib", "inf"],
    }
    procs = {expected: subprocess.Popen([sys.executable, "-m", "pagedllm", *argv], text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for expected, argv in cases.items()}
    for expected, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        lines = [line for line in err.splitlines() if line.strip()]
        assert proc.returncode == 2 and out == "", (expected, proc.returncode, out, err)
        assert len(lines) == 1 and lines[0].startswith("error: "), (expected, err)
        assert expected in lines[0] and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["generate", "--model", "{model}", "--prompt", "x", "--top-p", "0"],
     "--top-p must be in (0, 1], got 0.0"),
    (["generate", "--model", "{model}", "--prompt", "x", "--max-tokens", "0"],
     "--max-tokens must be >= 1, got 0"),
    (["generate", "--model", "{model}", "--prompt", "x", "--top-k", "0"], "--top-k must be -1 or"),
    (["generate", "--model", "{model}", "--prompt", "x", "--seed", "-1"], "--seed must be in [0"),
    (["generate", "--model", "{model}", "--prompt", "x", "--stop", ""],
     "--stop must be a non-empty"),
    (["generate", "--model", "{model}", "--prompt", "x", "--dtype", "int8"],
     "--dtype 'int8' is not supported"),
    (["generate", "--model", "{model}", "--prompt", "x", "--block-size", "0"],
     "--block-size must be >= 1"),
    # The engine's field names the flag when the command has one of that name (err.field,
    # not the message); a field no flag sets is told as the engine tells it.
    (["serve", "--model", "{model}", "--device", "cpu", "--max-num-seqs", "0"],
     "error: --max-num-seqs must be >= 1, got 0"),
    (["serve", "--model", "{model}", "--device", "cpu", "--num-gpu-blocks-override", "-1"],
     "error: num_gpu_blocks must be >= 1, got -1"),
    (["generate", "--model", "{model}", "--prompt", ""], "--prompt number 1 is empty"),
    (["generate", "--model", "{model}", "--prompt-ids", "1,two"],
     "--prompt-ids must be comma-separated integers, e.g. 1,2,3; 'two' is not one"),
    (["generate", "--model", "{model}", "--prompt-ids", " , "], "--prompt-ids is empty"),
    (["generate", "--model", "{model}", "--prompt-ids", "1", "--prompt", "x"], "not both"),
    (["generate", "--model", "{model}"], "give --prompt TEXT"),
    (["generate", "--model", "{model}/config.json", "--prompt", "x"], "is a file, not a folder"),
    (["kv-size", "opt-13b", "--tokens", "-5"], "--tokens must be >= 1, got -5"),
    (["kv-size", "opt-13b", "--memory-gib", "nan"], "--memory-gib must be a finite number"),
    (["kv-size", "opt-13b", "--memory-gib", "0"], "--memory-gib must be > 0, got 0.0"),
    (["kv-size", "opt-13b", "--memory-gib", "2e6"], "--memory-gib must be at most 1e+06 GiB"),
    (["kv-size", "opt-13b", "--memory-gib", "10", "--users", "-3"], "users must be >= 1, got -3"),
    (["kv-size", "opt-13b", "--memory-gib", "10", "--context", "-1"], "context must be >= 1"),
    (["kv-size", "opt-13b", "--dtype", "int8"], "dtype torch.int8 is not a floating dtype"),
    (["kv-size", "gpt-5"], "'gpt-5' is neither a preset nor a folder"),
])
def test_bad_flags_in_process(capsys, checkpoints, argv, message):
    from pagedllm.serving.cli import main

    argv = [a.replace("{model}", str(checkpoints["llama"])) for a in argv]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1
    assert message in captured.err and captured.out == ""


def test_a_bug_keeps_its_traceback(monkeypatch):
    from pagedllm.serving import cli

    def broken(args):
        raise RuntimeError("an internal bug")

    monkeypatch.setattr(cli.kv_size_cmd, "run", broken)
    with pytest.raises(RuntimeError, match="an internal bug"):
        cli.main(["kv-size", "opt-13b"])


def test_chat_keeps_the_conversation_and_survives_a_message_too_long():
    """pagedllm chat, fed by a pipe: every line is a user turn and gets an answer; a message
    that would push the conversation past max_model_len is refused in one line, and the
    conversation goes on."""
    from pagedllm.serving.default_model import default_model_dir

    too_long = "word " * 3000
    res = subprocess.run(
        [sys.executable, "-m", "pagedllm", "chat", "--model", str(default_model_dir()),
         "--max-tokens", "8"], input=f"The for statement\n{too_long}\nReturn a list\n",
        capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "max_model_len" in errors[0] and "dropped" in errors[0]
    assert len([line for line in res.stdout.splitlines() if line.strip()]) >= 2  # two answers


def test_chat_refuses_a_model_without_a_chat_template(checkpoints):
    res = run_cli("chat", "--model", str(checkpoints["llama"]), check=False)
    assert res.returncode == 2 and res.stderr.startswith("error: ")
    assert "chat template" in res.stderr and "Traceback" not in res.stderr
