"""Seed 003's deployment command, as a new user runs it (issue 41): the command the seed gives
for a 400B model on 8 x A100-80GB, with only the model and the host swapped (and ``--port 0``,
so that the test binds a free port), on both tiers. Every flag is taken: fp8 weights, a 16-bit
KV cache of another dtype than the model's, --pipeline-parallel-size 1, --disable-log-requests,
and --enable-flash-attn (which no vLLM release takes: told in one line, ignored). The server
answers a question on OpenAI's route and on the demo server's POST /generate."""

import re
import signal
import subprocess
import sys

import httpx
import pytest

from pagedllm.serving.cli import build_parser, main

SEED_003 = ("--model smollm2-135m-instruct --served-model-name my-llm --host 127.0.0.1 "
            "--tensor-parallel-size 1 --pipeline-parallel-size 1 --max-model-len 2048 "
            "--gpu-memory-utilization 0.9 --dtype bfloat16 --quantization fp8 "
            "--kv-cache-dtype fp16 --enable-flash-attn --enable-prefix-caching "
            "--enable-chunked-prefill --max-num-batched-tokens 8192 --max-num-seqs 128 "
            "--swap-space 4 --enforce-eager --disable-log-requests --seed 42").split()


def test_every_flag_of_the_command_parses():
    args = build_parser().parse_args(["serve", *SEED_003])
    assert (args.quantization, args.kv_cache_dtype) == ("fp8", "fp16")
    assert args.pipeline_parallel_size == 1 and args.disable_log_requests
    assert args.enable_flash_attn and args.swap_space == 4


def test_more_pipeline_stages_are_refused_naming_the_flag(capsys):
    assert main(["serve", "--pipeline-parallel-size", "2", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --pipeline-parallel-size 2:") and "tensor parallelism" in err
    assert err.count("\n") == 1  # one line, no traceback


@pytest.mark.parametrize("tier", ["optimized", "reference"])
def test_seed_003s_command_serves_and_answers(tier):
    server = subprocess.Popen(
        [sys.executable, "-m", "pagedllm.serving", *SEED_003, "--port", "0", "--tier", tier,
         "--uvicorn-log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in server.stdout:
            lines.append(line)
            if "on http://" in line or len(lines) > 200:
                break
        banner = lines[-1]
        match = re.search(r"serving my-llm \((\w+) tier.* on (http://127\.0\.0\.1:\d+)/v1",
                          banner)
        assert match and match.group(1) == tier, "".join(lines)
        url = match.group(2)
        notes = "".join(lines)
        assert notes.count("--enable-flash-attn") == 1 and "fused, tiled kernel" in notes
        chat = httpx.post(url + "/v1/chat/completions", timeout=300, json={
            "model": "my-llm", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert chat.status_code == 200, chat.text
        answer = chat.json()["choices"][0]["message"]["content"]
        assert answer.strip()
        demo = httpx.post(url + "/generate", timeout=300, json={
            "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0})
        assert demo.status_code == 200, demo.text
        (text,) = demo.json()["text"]
        assert text.startswith("The capital of France is") and len(text) > 24
    finally:
        server.send_signal(signal.SIGTERM)
        rest = server.communicate(timeout=60)[0]
    assert "Received request" not in notes + rest  # --disable-log-requests
