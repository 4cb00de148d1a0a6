"""The LLM that ``pagedllm serve`` serves, built from its flags: in the server's process, or in
each data-parallel replica's (``data_parallel``). A module of its own so that a replica loads
it without the server's modules (the app, the launcher)."""

import argparse
import logging

logger = logging.getLogger("pagedllm.serving")


def load_llm(args: argparse.Namespace):
    """The LLM of the chosen tier, configured from the flags (the engine checks them)."""
    import torch

    from .default_model import default_model_dir

    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    model = args.model or args.model_tag or default_model_dir()
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" \
        else args.device
    if args.preemption_mode == "swap" and args.swap_space == 0:
        raise ValueError("--preemption-mode swap moves blocks to CPU memory: give it some with "
                         "--swap-space GIB (e.g. --swap-space 1)")
    options = dict(dtype=args.dtype, device=device, block_size=args.block_size,
                   num_gpu_blocks=args.num_gpu_blocks_override,
                   kv_cache_memory=args.kv_cache_memory_bytes, swap_space=args.swap_space,
                   max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens,
                   max_model_len=args.max_model_len, preemption_mode=args.preemption_mode,
                   enable_prefix_caching=args.enable_prefix_caching,
                   enable_chunked_prefill=args.enable_chunked_prefill, seed=args.seed,
                   gpu_memory_utilization=args.gpu_memory_utilization,
                   enforce_eager=args.enforce_eager, kv_cache_dtype=args.kv_cache_dtype,
                   calculate_kv_scales=args.calculate_kv_scales,
                   quantization=args.quantization,
                   quantization_group_size=args.quantization_group_size,
                   quantization_skip=tuple(args.quantization_skip),
                   tensor_parallel_size=args.tensor_parallel_size,
                   pipeline_parallel_size=args.pipeline_parallel_size,
                   max_logprobs=args.max_logprobs,
                   speculative_config=args.speculative_config)
    if args.tier == "reference":
        options.update(_reference_tier(options, device))
    if args.tier == "optimized":
        from pagedllm.optimized import LLM
    else:
        from pagedllm.reference.engine.llm import LLM
    return LLM(model, **options)


def _reference_tier(options: dict, device: str) -> dict:
    """The optimized tier's flags that a command line for vLLM carries and the reference tier
    has nothing to do for: --enforce-eager (the reference never captures a graph: it is
    eager already) and, off CUDA, --gpu-memory-utilization (no GPU to profile: the optimized
    tier on a CPU sizes its pool from --kv-cache-memory-bytes too). Taken as met, and said;
    on CUDA the engine refuses --gpu-memory-utilization, which the reference cannot honour."""
    met = {}
    if options["enforce_eager"]:
        met["enforce_eager"] = False
        logger.info("--enforce-eager: the reference tier always runs eagerly")
    if options["gpu_memory_utilization"] is not None and not str(device).startswith("cuda"):
        met["gpu_memory_utilization"] = None
        logger.info("--gpu-memory-utilization: no GPU to profile on %s; the KV pool is "
                    "--kv-cache-memory-bytes (default 256 MiB)", device)
    return met
