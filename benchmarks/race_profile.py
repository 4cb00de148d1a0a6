"""Where the CPU race's gap to the real vLLM goes: prompts or output tokens, and inside our
decode step, the model or the engine around it.

The race (``throughput_cpu.py --model smollm2-135m-instruct --systems optimized,vllm``) gives
one number per system: output tokens per CPU second over 32 requests of a few hundred prompt
tokens and up to ~250 output tokens, 16 at a time. This splits it, on the same workload, the
same engines and one thread each:

1. **Prefill against decode.** Each system runs the workload twice in one process: as it is,
   and with every output cut to one token (the prompts alone). The CPU time of the second is
   what the prompts cost; the difference, what the other output tokens cost — per output token,
   the decode cost each engine pays, side by side.
2. **Our decode step inside.** Steady decode steps of our engine (16 sequences, as built: the
   backend it chose, its one-call decode step) under ``torch.profiler``: the share of a step in
   the model (the C++ call, or the modules' operators) and in the engine's Python around it
   (scheduling, step inputs, sampling, outputs), and the top operators.

    python benchmarks/race_profile.py                       # float32 and bfloat16
    python benchmarks/race_profile.py --precision float32 --json /tmp/race_profile.json
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from pagedllm.benchmarks import throughput_cpu as race
from pagedllm.benchmarks.bench_report import write_json
from pagedllm.benchmarks.systems import BLOCK_SIZE, vllm_runs
from pagedllm.optimized import LLM
from pagedllm.reference import SamplingParams

MODEL = "smollm2-135m-instruct"


def our_runs(workloads: list, ckpt: Path, *, dtype: str, batch: int, max_len: int,
             warm) -> list[dict]:
    """Our optimized engine (as the race configures it) on each workload in turn, in one
    engine: CPU and wall seconds of each."""
    llm = LLM(ckpt, dtype=dtype, max_num_seqs=batch, max_model_len=max_len,
              block_size=BLOCK_SIZE, num_gpu_blocks=batch * -(-max_len // BLOCK_SIZE),
              kv_layout="paged", batching="continuous", enable_chunked_prefill=True)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for _, n in warm]
    llm.generate([{"prompt_token_ids": ids} for ids, _ in warm], params, use_tqdm=False)
    runs = []
    for work in workloads:
        prompts = [{"prompt_token_ids": ids} for ids, _ in work]
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                  for _, n in work]
        cpu, wall = time.process_time(), time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append({"cpu": time.process_time() - cpu, "wall": time.perf_counter() - wall,
                     "tokens": [o.outputs[0].token_ids for o in outs]})
    return runs


def split(runs: list[dict], work) -> dict:
    """Prompts-only and full runs -> the CPU seconds of each part and per output token."""
    prompts_only, full = runs
    decode_tokens = sum(n - 1 for _, n in work)
    return {"cpu_full_s": full["cpu"], "cpu_prompts_s": prompts_only["cpu"],
            "cpu_decode_s": full["cpu"] - prompts_only["cpu"],
            "decode_ms_per_token": 1e3 * (full["cpu"] - prompts_only["cpu"]) / decode_tokens,
            "prompt_tokens": sum(len(ids) for ids, _ in work),
            "output_tokens": sum(n for _, n in work),
            "tok_per_cpu_s": sum(n for _, n in work) / full["cpu"]}


def step_profile(ckpt: Path, *, dtype: str, batch: int, context: int, steps: int) -> dict:
    """`steps` steady decode steps of `batch` sequences of `context` prompt tokens under
    torch.profiler: the model's share (the one-call step or the modules' operators) and the
    engine's (the rest of engine.step), and the top operators by self CPU time."""
    llm = LLM(ckpt, dtype=dtype, max_num_seqs=batch, max_model_len=context + steps + 64,
              block_size=BLOCK_SIZE, enable_chunked_prefill=True)
    engine = llm.engine
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        ids = torch.randint(0, 1000, (context,), generator=g).tolist()
        engine.add_request(f"p{i}", {"prompt_token_ids": ids},
                           SamplingParams(temperature=0.0, max_tokens=steps + 48,
                                          ignore_eos=True))
    seen = []
    engine.add_step_observer(lambda eng, sched, inputs: seen.append(len(inputs.input_ids)))
    while not seen or seen[-1] != batch:  # until every prompt is in and a step decodes all
        engine.step()
    for _ in range(4):
        engine.step()
    cpu = time.process_time()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    step_ms = 1e3 * (time.process_time() - cpu) / steps
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)  # the profiler's view of the steps
    # the layers' one C++ call (optimized/decode_step.py labels it), with the products it
    # records inside it: its inclusive time
    layers = sum(e.cpu_time_total for e in events if e.key == "pagedllm::decode_layers")
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]
    return {"batch": batch, "context": context, "steps": steps, "step_cpu_ms": step_ms,
            "layers_share": layers / total,
            "top": [(e.key, e.self_cpu_time_total / total, e.count // steps) for e in top]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="float32,bfloat16",
                        help="comma-separated: float32, bfloat16")
    parser.add_argument("--no-vllm", action="store_true", help="our engine only")
    parser.add_argument("--steps", type=int, default=20, help="profiled decode steps")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt, work, config = race.prepare(Path(tmp), "model", MODEL)
    batch, max_len = race.SIZES["model"][2], config["workload"]["max_model_len"]
    warm = [(ids[:8], 4) for ids, _ in work[:2]]
    prompts_only = [(ids, 1) for ids, _ in work]
    mean_prompt = round(sum(len(ids) for ids, _ in work) / len(work))
    report = {"config": config, "split": {}, "profile": {}}
    for dtype in args.precision.split(","):
        rows = {"ours": split(our_runs([prompts_only, work], ckpt, dtype=dtype, batch=batch,
                                       max_len=max_len, warm=warm), work)}
        if not args.no_vllm:
            try:
                result = vllm_runs([prompts_only, work], ckpt, dtype=dtype, batch=batch,
                                   max_len=max_len, threads=1, warm=warm)
                rows["vllm"] = split(result["runs"], work)
            except RuntimeError as e:
                rows["vllm"] = {"error": str(e).splitlines()[0]}
        report["split"][dtype] = rows
        report["profile"][dtype] = step_profile(ckpt, dtype=dtype, batch=batch,
                                                context=mean_prompt, steps=args.steps)
    print(f"\n== {MODEL}: {len(work)} requests, {batch} at a time, 1 thread; CPU seconds ==")
    print(f"{'dtype':9} {'system':6} {'prompts':>8} {'decode':>8} {'ms/out tok':>10} "
          f"{'tok/CPU-s':>9}")
    for dtype, rows in report["split"].items():
        for name, r in rows.items():
            if "error" in r:
                print(f"{dtype:9} {name:6} n/a: {r['error']}")
                continue
            print(f"{dtype:9} {name:6} {r['cpu_prompts_s']:8.1f} {r['cpu_decode_s']:8.1f} "
                  f"{r['decode_ms_per_token']:10.2f} {r['tok_per_cpu_s']:9.1f}")
        if "cpu_full_s" in rows.get("vllm", {}):
            ours, vllm = rows["ours"], rows["vllm"]
            print(f"{dtype:9} ours/vLLM CPU time: prompts "
                  f"{ours['cpu_prompts_s'] / vllm['cpu_prompts_s']:.2f}x, "
                  f"decode {ours['cpu_decode_s'] / vllm['cpu_decode_s']:.2f}x")
    for dtype, p in report["profile"].items():
        print(f"\n== our decode step, {dtype}: {p['batch']} sequences at ~{p['context']} tokens, "
              f"{p['step_cpu_ms']:.1f} ms CPU per step; the layers' one C++ call "
              f"{100 * p['layers_share']:.0f}% of the profiled CPU time ==")
        for key, share, count in p["top"]:
            print(f"  {100 * share:5.1f}%  {count:4d}/step  {key}")
    if args.json:
        write_json(report, args.json)
    return report


if __name__ == "__main__":
    main()
