"""Decode steps of both tiers as the context grows: how far the optimized tier pulls ahead on a
CPU (lesson 14's table).

The model is tier_profile.py's (the throughput benchmark's "full" random-weight Llama: hidden
512, 8 layers, 8 query heads on 2 K/V heads, a vocabulary of 8192; about 31M parameters in
float32). For each context length the script measures two things, one torch thread, in this
process's CPU time (steadier than wall time on a shared machine):

- attention alone: the decode attention of one step (8 layers) for NUM_SEQS sequences of that
  context, on the same random paged cache with shuffled block tables (a pool after much
  traffic; a fresh engine's blocks lie in order, which reads faster), through the reference's
  op (``reference.ops.paged_attention``: one indexed copy of a short row per key and K/V head)
  and through the optimized tier's CPU path (``optimized.attention``: one plan per step, then
  per layer a gather of whole blocks and one fused attention product); the median of CALLS;
- whole decode steps: both tiers' ``LLM`` with their own backends (not wrapped in profiler
  labels, as tier_profile.py's are: handed a wrapped attention op, the optimized tier's runner
  attends through it instead of its planned CPU path) get the same NUM_SEQS prompts
  of that many tokens, prefill them, decode a few warm-up steps, then take turns for ROUNDS
  rounds of one timed step each (the median), and must agree on every greedy token.

The weights a step reads do not grow with the context; the keys and values its attention
gathers do, the same bytes in both tiers. ``--runs N`` repeats everything with fresh engines
and prints the median and the range of the N runs.

    .venv/bin/python lessons/figures/tier_context.py                 # about 4 minutes
    .venv/bin/python lessons/figures/tier_context.py --runs 3 --json /tmp/tier_context.json
"""

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pagedllm.optimized import LLM as OptimizedLLM
from pagedllm.optimized.attention import attend, plan_attention
from pagedllm.reference import LLM as ReferenceLLM
from pagedllm.reference import SamplingParams
from pagedllm.reference.model.random_checkpoint import tiny_config, write_random_checkpoint
from pagedllm.reference.ops import paged_attention

MODEL = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=2)  # benchmarks/throughput_cpu.py "full"
INIT_STD = 0.2
CONTEXTS = (64, 512, 2048)  # prompt tokens per sequence
NUM_SEQS, BLOCK_SIZE = 16, 16
WARMUP_STEPS, ROUNDS, CALLS = 2, 8, 7
TIERS = {"reference": ReferenceLLM, "optimized": OptimizedLLM}


def cpu_ms(fn) -> float:
    start = time.process_time()
    fn()
    return (time.process_time() - start) * 1000


def attention_alone(context: int, seqs: int) -> dict:
    """CPU ms of one decode step's attention (every layer), in each tier's way."""
    layers, heads = MODEL["num_hidden_layers"], MODEL["num_attention_heads"]
    kv_heads = MODEL["num_key_value_heads"]
    head_dim = MODEL["hidden_size"] // heads
    per_seq = -(-context // BLOCK_SIZE)
    g = torch.Generator().manual_seed(context)
    # A pool after some churn: each sequence's blocks are scattered, not consecutive.
    tables = torch.randperm(seqs * per_seq, generator=g).view(seqs, per_seq).int()  # [B, W]
    shape = (seqs * per_seq, BLOCK_SIZE, kv_heads, head_dim)
    k_caches = [torch.randn(shape, generator=g) for _ in range(layers)]
    v_caches = [torch.randn(shape, generator=g) for _ in range(layers)]
    q = torch.randn(seqs, heads, head_dim, generator=g)  # [B, heads, head_dim]
    seq_lens = torch.full((seqs,), context, dtype=torch.int32)  # [B]
    starts = torch.arange(seqs + 1, dtype=torch.int32)  # [B + 1]: one query each
    scale = head_dim ** -0.5

    def reference():
        return [paged_attention(q, k, v, tables, seq_lens, starts, scale)
                for k, v in zip(k_caches, v_caches, strict=True)]

    def optimized():
        plan = plan_attention(tables, seq_lens, starts, BLOCK_SIZE)  # once per step
        return [attend(plan, q, k, v, scale) for k, v in zip(k_caches, v_caches, strict=True)]

    for a, b in zip(reference(), optimized(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    times = {"reference": [], "optimized": []}
    for _ in range(CALLS):  # alternating, so that a busy neighbour slows both alike
        times["reference"].append(cpu_ms(reference))
        times["optimized"].append(cpu_ms(optimized))
    return {name: statistics.median(t) for name, t in times.items()}


def decoding(llm_class, ckpt: Path, context: int, seqs: int):
    """The tier's LLM with `seqs` sequences of `context` prompt tokens prefilled and a few
    decode steps done."""
    max_len = context + WARMUP_STEPS + ROUNDS + 8
    blocks_per_seq = -(-max_len // BLOCK_SIZE)
    llm = llm_class(ckpt, max_num_seqs=seqs, block_size=BLOCK_SIZE, max_model_len=max_len,
                    num_gpu_blocks=seqs * blocks_per_seq)
    params = SamplingParams(temperature=0.0, max_tokens=max_len - context, ignore_eos=True)
    for i in range(seqs):
        prompt = [(7 * i + 13 * j + 1) % MODEL["vocab_size"] for j in range(context)]
        llm.engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    while llm.stats()["decode_tokens"] < seqs * WARMUP_STEPS:  # prefill, then warm-up
        llm.engine.step()
    return llm


def decode_steps(ckpt: Path, context: int, seqs: int) -> dict:
    """CPU ms of one whole decode step in each tier (the median of ROUNDS, alternating)."""
    llms = {name: decoding(cls, ckpt, context, seqs) for name, cls in TIERS.items()}
    times = {name: [] for name in llms}
    for _ in range(ROUNDS):
        for name, llm in llms.items():
            times[name].append(cpu_ms(llm.engine.step))
    tokens = []
    for llm in llms.values():
        outputs = []
        while llm.engine.has_unfinished_requests():
            outputs += [o for o in llm.engine.step() if o.finished]
        tokens.append(sorted((o.request_id, list(o.outputs[0].token_ids)) for o in outputs))
    assert tokens[0] == tokens[1], "the tiers disagree on greedy tokens"
    return {name: statistics.median(t) for name, t in times.items()}


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    parser.add_argument("--seqs", type=int, default=NUM_SEQS, help="sequences decoding")
    parser.add_argument("--runs", type=int, default=1, help="repeat everything, fresh engines")
    parser.add_argument("--json", type=Path, default=None, help="write all numbers here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        cfg = tiny_config("llama", max_position_embeddings=max(args.contexts) + 64, **MODEL)
        ckpt = write_random_checkpoint(Path(tmp) / "llama", cfg, seed=0, init_std=INIT_STD)
        for run in range(args.runs):
            runs.append({c: {"attention_ms": attention_alone(c, args.seqs),
                             "step_ms": decode_steps(ckpt, c, args.seqs)}
                         for c in args.contexts})
            print(f"run {run + 1}: " + "; ".join(
                f"{c} tokens: step {r['step_ms']['reference']:.1f} / "
                f"{r['step_ms']['optimized']:.1f} ms, attention "
                f"{r['attention_ms']['reference']:.1f} / {r['attention_ms']['optimized']:.1f} ms"
                for c, r in runs[-1].items()) + " (reference / optimized)", flush=True)
    rows = {}
    for c in args.contexts:
        row = {f"{key}_{tier}": spread([r[c][key][tier] for r in runs])
               for key in ("step_ms", "attention_ms") for tier in TIERS}
        for key in ("step_ms", "attention_ms"):
            row[f"{key}_speedup"] = spread([r[c][key]["reference"] / r[c][key]["optimized"]
                                            for r in runs])
        rows[c] = row

    def cell(s: dict, fmt: str = "{:.1f}") -> str:
        text = fmt.format(s["median"])
        if args.runs > 1:
            text += f" ({fmt.format(s['min'])}–{fmt.format(s['max'])})"
        return text

    print(f"\n{args.seqs} sequences decoding, 1 thread, CPU ms per decode step; median (min–max) "
          f"of {args.runs} run(s); reference / optimized")
    print("| context | whole step | speed-up | attention (8 layers) | speed-up |")
    print("|---:|---:|---:|---:|---:|")
    for c, row in rows.items():
        print(f"| {c} | {cell(row['step_ms_reference'])} / {cell(row['step_ms_optimized'])} | "
              f"{cell(row['step_ms_speedup'], '{:.2f}')}× | "
              f"{cell(row['attention_ms_reference'])} / {cell(row['attention_ms_optimized'])} | "
              f"{cell(row['attention_ms_speedup'], '{:.2f}')}× |")
    result = {"model": MODEL, "num_seqs": args.seqs, "block_size": BLOCK_SIZE,
              "warmup_steps": WARMUP_STEPS, "rounds": ROUNDS, "attention_calls": CALLS,
              "runs": runs, "rows": rows, "clock": "process CPU time",
              "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
              "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count()}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
