"""The server as a new user starts it: `python -m pagedllm.serving` with vLLM's flags, on
127.0.0.1 by default; preemption and prefix-cache metrics move under a small KV pool."""

import re
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai

from pagedllm.serving.cli import build_parser

from .test_metrics import scrape, value


def test_serve_flags_and_default_bind():
    args = build_parser().parse_args(["serve"])
    assert args.host == "127.0.0.1" and args.port == 8000 and args.tier == "optimized"
    assert args.model is None and args.api_key is None
    assert args.max_logprobs == 20  # vLLM's default
    args = build_parser().parse_args([
        "serve", "--model", "x", "--served-model-name", "y", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "512", "--max-model-len", "256", "--block-size", "8",
        "--gpu-memory-utilization", "0.8", "--swap-space", "1", "--preemption-mode", "swap",
        "--enable-prefix-caching", "--enable-chunked-prefill", "--enforce-eager", "--seed", "3",
        "--dtype", "bfloat16", "--tier", "reference", "--api-key", "k", "--kv-cache-dtype", "fp8",
        "--calculate-kv-scales", "--max-logprobs", "-1"])
    assert (args.max_num_seqs, args.max_num_batched_tokens, args.max_model_len) == (8, 512, 256)
    assert args.max_logprobs == -1
    assert args.kv_cache_dtype == "fp8" and args.calculate_kv_scales


def test_python_m_pagedllm_serving_with_a_small_pool():
    server = subprocess.Popen(
        [sys.executable, "-m", "pagedllm.serving", "--port", "0", "--block-size", "4",
         "--num-gpu-blocks-override", "24", "--enable-prefix-caching", "--max-num-seqs", "8",
         "--kv-cache-dtype", "int8", "--uvicorn-log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # the banner; lines before it (a first use's kernel build notice) are passed over
        banner = next((line for line in server.stdout if " serving " in line or "/v1" in line),
                      "the server ended without a banner")
        match = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", banner)
        assert match, banner  # the default bind address is loopback
        url = match.group(1)
        assert "24 KV blocks of 4 tokens" in banner
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                               timeout=120)
        prompt = "The for statement is used to iterate over the elements"

        def one(i):
            return client.completions.create(
                model="tiny-pydoc", prompt=prompt, max_tokens=30 + i, temperature=0,
                extra_body={"ignore_eos": True}).choices[0].text

        with ThreadPoolExecutor(8) as pool:  # 8 x ~11 blocks at the end, 24 in the pool
            texts = list(pool.map(one, range(8)))
        for i, text in enumerate(texts[1:], 1):
            assert text.startswith(texts[0]) or texts[0].startswith(text[:len(texts[0])]), i
        m = scrape(url)
        assert value(m, "num_preemptions_total", mode="recompute") > 0
        assert value(m, "prefix_cache_hits_total") > 0
        assert 0 < value(m, "gpu_prefix_cache_hit_rate") <= 1
        assert value(m, "prefix_cache_queries_total") >= value(m, "prefix_cache_hits_total")
        # the tiny model in int8: 2 x 4 layers x 2 KV heads x (32 values + a 2-byte scale)
        assert value(m, "kv_cache_bytes_per_token") == 2 * 4 * 2 * (32 + 2)
        assert value(m, "kv_cache_capacity_tokens") == 24 * 4
        assert httpx.get(url + "/health").status_code == 200
    finally:
        server.terminate()
        server.wait(30)
    # uvicorn shuts down gracefully, then re-raises the signal it caught
    assert server.returncode in (0, -signal.SIGTERM)
