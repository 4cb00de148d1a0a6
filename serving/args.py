"""The flags of ``pagedllm serve``: vLLM's names where the meaning matches (``vllm serve`` and
its ``vllm.entrypoints.api_server``), so a vLLM command line carries over. Kept apart from the
server so that the other commands start without importing FastAPI."""

import argparse

DEFAULT_MAX_REQUEST_BYTES = 1 << 20  # 1 MiB: about 250,000 tokens of prompt text
DEFAULT_REQUEST_TIMEOUT = 600.0  # seconds
DTYPES = ("auto", "float32", "float16", "bfloat16")
DTYPE_HELP = ("auto (the default): the checkpoint's dtype on CUDA (bfloat16 for SmolLM2 and the "
              "Llama family), float32 on the CPU")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8", "int4", "float16", "fp16",
                   "bfloat16", "bf16")
KV_CACHE_DTYPE_HELP = ("how the KV cache stores keys and values: auto (the model's dtype), fp8 "
                       "(= fp8_e4m3) or fp8_e5m2 with a per-tensor scale per layer, int8 or "
                       "int4 with a scale per token and KV head (about 2x and 4x the tokens of "
                       "a bf16 cache), or a 16-bit dtype (float16/fp16, bfloat16/bf16): the "
                       "model's own is auto, another a cache rounded to it")
FLASH_ATTN_NOTE = ("--enable-flash-attn: no vLLM release takes this flag, and pagedllm needs "
                   "none: attention already runs in the fused, tiled kernel (online softmax, "
                   "FlashAttention's algorithm) on every path; ignored")


def add_kv_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """How the engine stores and splits the model (vLLM's names): --kv-cache-dtype,
    --calculate-kv-scales, --quantization*, --tensor-parallel-size; serve and generate."""
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help=KV_CACHE_DTYPE_HELP)
    parser.add_argument("--calculate-kv-scales", action="store_true",
                        help="fp8: set the per-tensor scales from the first batch instead of "
                        "1.0 (values beyond fp8's range would be clipped)")
    parser.add_argument("--quantization", "-q", choices=("int8", "int4", "fp8", "gguf"),
                        default=None,
                        help="quantize the linear layers' weights at load: int8 (a scale per "
                        "output channel), fp8 (e4m3, a scale per output channel), int4 (a "
                        "scale and zero point per group of inputs) or "
                        "gguf "
                        "(a .gguf model's own Q4_0/Q4_1 blocks, not expanded); with --dtype "
                        "auto the model then runs in bfloat16")
    parser.add_argument("--quantization-group-size", type=int, default=32,
                        help="int4: inputs per group, 32, 64, 128 or 256 (default 32, the "
                        "blocks of llama.cpp's Q4 formats)")
    parser.add_argument("--quantization-skip", nargs="+", default=[], metavar="LAYER",
                        help="linear layers to leave unquantized: a layer's module name or a run "
                        "of its dot-separated parts, e.g. lm_head or mlp.down_proj (a name "
                        "matching no layer is refused)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="ranks splitting every layer, each a process with its shard and "
                        "its KV heads (gloo on the CPU, NCCL with one GPU per rank)")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help='speculative decoding (vLLM\'s shape): \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                        '"prompt_lookup_min": 2}\' or \'{"model": DRAFT, '
                        '"num_speculative_tokens": 4}\'; never changes a token')
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                        help="vLLM's flag; 1 only: layers are split across GPUs by "
                        "--tensor-parallel-size, never into pipeline stages")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's flag names where the meaning matches (``vllm serve`` / its api_server)."""
    parser.add_argument("model_tag", nargs="?", help="the model, as --model")
    parser.add_argument("--model", help="a checkpoint folder, a .gguf file or a model name such "
                        "as smollm2-135m-instruct (default: the tiny model that ships with "
                        "pagedllm)")
    parser.add_argument("--served-model-name", help="the name clients use in 'model' (default: "
                        "the --model value, or tiny-pydoc)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default "
                        "127.0.0.1: this machine only; 0.0.0.0 opens it to the network)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/*")
    parser.add_argument("--tier", choices=("optimized", "reference"), default="optimized")
    parser.add_argument("--device", default="auto", help="cpu, cuda, ... (default: cuda when "
                        "available)")
    parser.add_argument("--dtype", default="auto", choices=DTYPES, help=DTYPE_HELP)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, help="prompt + output tokens per request "
                        "(default: the model's positions)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--max-logprobs", type=int, default=20,
                        help="the most logprobs, top_logprobs or prompt_logprobs a request may "
                        "ask for (vLLM's default 20); more is a 400. -1: no cap but the "
                        "vocabulary (prompt_logprobs -1, the whole vocabulary, needs it)")
    parser.add_argument("--gpu-memory-utilization", type=float,
                        help="optimized tier on CUDA: share of GPU memory to fill (default 0.9)")
    parser.add_argument("--kv-cache-memory-bytes", type=int, help="bytes of KV cache (default "
                        "256 MiB, or --gpu-memory-utilization on CUDA)")
    parser.add_argument("--num-gpu-blocks-override", type=int, help="KV blocks in the pool, "
                        "whatever the memory settings say")
    parser.add_argument("--swap-space", type=float, default=0.0, help="GiB of CPU memory for "
                        "swapped-out KV blocks (vLLM's default is 4; here 0 unless "
                        "--preemption-mode swap)")
    parser.add_argument("--preemption-mode", choices=("recompute", "swap"), default="recompute")
    parser.add_argument("--enable-prefix-caching", action="store_true")
    parser.add_argument("--enable-chunked-prefill", action="store_true")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="optimized tier: no CUDA graphs, and on a CPU no one-call "
                             "decode step: every step through the modules")
    add_kv_cache_arguments(parser)
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                        help="engine replicas, each a process with the whole model (or its "
                        "--tensor-parallel-size ranks) and its own KV pool, behind this one "
                        "server; each request goes to the least-loaded replica")
    parser.add_argument("--seed", type=int, default=0,
                        help="the engine's seed for requests that bring none (with "
                        "--data-parallel-size, replica i derives its own from it)")
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                        help="larger request bodies get 413")
    parser.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT,
                        help="seconds before a request is aborted (0: no limit)")
    parser.add_argument("--disable-log-requests", action="store_true",
                        help="do not log each request (its id, prompt length and sampling "
                        "parameters, at INFO), as vLLM's flag")
    parser.add_argument("--enable-flash-attn", action="store_true",
                        help="taken from older command lines and ignored: attention always "
                        "runs in the fused, tiled kernel")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=("critical", "error", "warning", "info", "debug", "trace"))
