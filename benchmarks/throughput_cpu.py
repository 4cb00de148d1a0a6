"""The throughput race on the CPU: our engine against Hugging Face transformers, one workload.

One random-weight Llama-style checkpoint, one seeded mixed workload of ShareGPT-like requests
(all of them queued at once, as in an offline throughput benchmark; each request generates
exactly its own output length: max_tokens = its length, EOS ignored, greedy), measured in one
run on the same CPU threads:

(a) ours, paged KV + continuous batching with chunked prefill (vLLM V1's design), in the
    optimized tier and in the reference tier;
(b) ours, contiguous KV reserved for max_model_len per request + static batching (the
    "traditional" system of the PagedAttention paper and the seed articles);
(c) transformers ``model.generate`` on static batches in arrival order, left-padded to the
    batch's longest prompt (attention_mask), max_new_tokens = the batch's longest output. Only
    each request's own output tokens count: the padding, and the tokens a request is dragged
    through after its own length while the batch's longest request finishes, are waste;
(d) transformers' continuous batching over its paged cache, the machinery behind
    ``model.generate_batch``. ``generate_batch`` takes one max_new_tokens for every request, so
    we drive the same manager the way it does (``continuous_batching_context_manager``,
    ``add_request``, ``get_result``) with each request's own max_new_tokens.

Every system gets the same batch size (max_num_seqs / static batch / max_requests_per_batch),
the same KV memory (batch size x max_model_len token slots) and the same number of torch
threads. Each system is warmed up on two short requests before its timed run. The table gives
useful output tokens per second and the ratio to transformers ``generate``; the JSON also says
how many requests got exactly the tokens of the first system (greedy: all of them should).

Threads: one per system by default (``--threads 0`` takes torch's default, one per core). On a
machine shared with other jobs, a second OpenMP thread waiting for a busy core stalls every
small operator: we saw decode steps of our engine, which dispatches about 12,000 small
operators per step, go from 35 ms to 650 ms on 2 cores next to a training job. One thread
measures the engines, not the neighbours. On an idle machine, compare with ``--threads 2``.
Timings are ratios measured side by side in one run; absolute numbers move with the load. The
table also gives each system's CPU time (this process, all threads): other jobs stretch wall
time, not CPU time, so on a busy machine the CPU-time ratios are the steadier ones.

    python benchmarks/throughput_cpu.py                 # full size; about 4 minutes on a core
    python benchmarks/throughput_cpu.py --quick --json /tmp/throughput.json   # under a minute
    python benchmarks/throughput_cpu.py --profile       # where (a) spends its time

``--profile`` runs the whole workload through (a) step by step with timers around the engine's
functions and splits the time: by kind of step (prefill, decode with a full batch, decode of the
last requests once the queue is empty), and by where it goes (matrix products, the
per-sequence attention loop: its math, the K/V store and gather, the slot mapping; the rest of
the model; the engine's Python bookkeeping), over the whole run and over a window of
steady-state decode steps, then prints torch.profiler's top operators for a few steps.

transformers' continuous batching logs that it cannot read the memory without psutil: harmless
here, its cache is sized explicitly (num_blocks, max_batch_tokens).
"""

import argparse
import math
import os
import platform
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from pagedllm.optimized import LLM as OptimizedLLM
from pagedllm.reference.engine.llm import LLM
from pagedllm.reference.engine.sampling_params import SamplingParams
from pagedllm.reference.model.config import load_config
from pagedllm.reference.model.random_checkpoint import tiny_config, write_random_checkpoint
from pagedllm.reference.model.registry import resolve_model
from pagedllm.reference.sim.traces import SHAREGPT, LengthModel, synthetic_trace

sys.path.insert(0, str(Path(__file__).parent))  # run by path or loaded by the tests
from bench_report import write_json  # noqa: E402

# The model: Llama-style, grouped-query attention (full: 8 query heads share 2 K/V heads; quick:
# 4 share 1), head_dim 64, float32. About 31M parameters (full) and 5M (quick): big enough that
# the matrix products are real work on a CPU, small enough that the race takes minutes.
MODELS = {
    "full": dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                 num_attention_heads=8, num_key_value_heads=2),
    "quick": dict(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=1),
}
INIT_STD = 0.2  # as the tests use: decisive greedy choices, so the systems' tokens can be compared

# The workload: ShareGPT-like log-normal lengths (reference/sim/traces.py: the paper's means, same
# spreads) with the means and the maximum length divided by SCALE, so that the shape (a long
# tail of long outputs) survives while the CPU finishes in minutes.
SIZES = {  # name: (requests, SCALE, batch size)
    "full": (128, 4, 16),
    "quick": (64, 8, 16),
    "model": (32, 4, 16),  # --model: a real checkpoint (SmolLM2-135M is 4x the full model)
}
PAPER_MAX_LEN = 2048  # OPT-13B's context, the paper's clip
BLOCK_SIZE = 16
SEED = 0

SYSTEMS = ("optimized", "paged_continuous", "contiguous_static", "hf_generate",
           "hf_generate_batch")
LABELS = {
    "optimized": "ours, optimized tier: paged + continuous",
    "paged_continuous": "ours: paged + continuous",
    "contiguous_static": "ours: contiguous + static",
    "hf_generate": "transformers generate (static, padded)",
    "hf_generate_batch": "transformers generate_batch (continuous)",
}


# -- setup ------------------------------------------------------------------------------------
def write_checkpoint(root: Path, size: str, max_len: int) -> tuple[Path, int]:
    # Positions to 2 x max_len: transformers' generate runs a padded batch past max_len (the
    # longest prompt plus the longest output, of two different requests); our engines stop at
    # max_model_len = max_len.
    cfg = tiny_config("llama", max_position_embeddings=2 * max_len, **MODELS[size])
    path = write_random_checkpoint(root / f"llama-{size}", cfg, seed=SEED, init_std=INIT_STD)
    from transformers import AutoModelForCausalLM

    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())
    return path, params


def real_checkpoint(model: str, max_len: int) -> tuple[Path, int, dict]:
    """A named model (smollm2-135m-instruct), a .gguf file or a folder: its folder, parameter
    count and the config fields the report shows."""
    path = resolve_model(model)
    cfg = load_config(path)
    if cfg.max_position_embeddings < 2 * max_len:
        raise ValueError(f"{model} has {cfg.max_position_embeddings} positions; the race needs "
                         f"{2 * max_len} (transformers' padded batches run past max_len)")
    from transformers import AutoModelForCausalLM

    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())
    fields = dict(name=str(model), vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                  intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                  num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads)
    return path, params, fields


def make_workload(num_requests: int, scale: int, vocab_size: int, seed: int = SEED):
    """[(prompt token ids, output length)] in arrival order, and the length model used."""
    model = LengthModel(f"sharegpt-like / {scale}", SHAREGPT.prompt_mean / scale,
                        SHAREGPT.prompt_sigma, SHAREGPT.output_mean / scale,
                        SHAREGPT.output_sigma)
    trace = synthetic_trace(model, num_requests, rate=1.0, seed=seed,
                            max_len=PAPER_MAX_LEN // scale)
    rng = np.random.default_rng(seed + 1)
    eos = vocab_size - 1  # never in a prompt
    return [(rng.integers(0, eos, r.prompt_len).tolist(), r.output_len) for r in trace], model


def batches(items: list, size: int) -> list[list]:
    return [items[i: i + size] for i in range(0, len(items), size)]


# -- the four systems -------------------------------------------------------------------------
class Clock:
    """Wall time and this process's CPU time (all its threads) over a timed section. With one
    thread and an idle machine they agree; when other jobs take the CPU, wall time grows and
    CPU time does not, so CPU time is the steadier measure of the work done."""

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def ours(ckpt: Path, layout: str, batching: str, work, batch: int, max_len: int, tier=LLM):
    # Continuous batching schedules as vLLM V1 does (and transformers' continuous batching):
    # prompts ride in the same steps as the running decodes (chunked prefill), so admitting a
    # request costs no step of its own in which every running sequence waits.
    llm = tier(ckpt, kv_layout=layout, batching=batching, reservation_policy="max",
              max_num_seqs=batch, max_model_len=max_len, block_size=BLOCK_SIZE,
              num_gpu_blocks=batch * max_len // BLOCK_SIZE,
              enable_chunked_prefill=batching == "continuous")

    def run(items):
        prompts = [{"prompt_token_ids": ids} for ids, _ in items]
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                  for _, n in items]
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    run([(ids[:8], 4) for ids, _ in work[:2]])  # warm-up
    with Clock() as clock:
        tokens = run(work)
    stats = llm.stats()
    extra = {k: stats[k] for k in ("preemptions_recompute", "prefill_tokens", "decode_tokens")}
    return tokens, clock, extra


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """A static batch for transformers' generate: prompts left-padded to the longest, and the
    attention mask that hides the padding. Returns (input_ids, attention_mask) [B, longest]."""
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros(len(prompts), longest, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt):] = torch.tensor(prompt)
        mask[row, longest - len(prompt):] = 1
    return ids, mask


def load_hf(ckpt: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # ignore EOS: every request runs its length
    model.generation_config.pad_token_id = 0
    return model


def hf_generate(ckpt: Path, work, batch: int):
    model = load_hf(ckpt)

    @torch.inference_mode()
    def run(items):
        tokens, generated = [], 0
        for group in batches(items, batch):
            new = max(n for _, n in group)
            ids, mask = left_padded([prompt for prompt, _ in group])
            longest = ids.shape[1]
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=new)
            assert out.shape == (len(group), longest + new), out.shape
            generated += len(group) * new
            tokens += [out[row, longest: longest + n].tolist() for row, (_, n) in enumerate(group)]
        return tokens, generated

    run([(ids[:8], 4) for ids, _ in work[:2]])  # warm-up
    with Clock() as clock:
        tokens, generated = run(work)
    return tokens, clock, {"generated_tokens_incl_waste": generated}


def finished_results(manager, ids: list[str], seconds: float = math.inf) -> tuple[dict, bool]:
    """The finished results of transformers' continuous-batching manager, by request id, until
    every request is done or `seconds` have passed; and whether time ran out first."""
    results, began = {}, time.perf_counter()
    while len(results) < len(ids):
        if time.perf_counter() - began > seconds:
            return results, True
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"generate_batch failed: {result.error}")
            results[result.request_id] = result
        elif result is None and not manager.is_running():
            raise RuntimeError("transformers' continuous batching thread stopped")
    return results, False


def hf_generate_batch(ckpt: Path, work, batch: int, max_len: int):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = load_hf(ckpt)
    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0)  # -1: EOS off
    page = BLOCK_SIZE
    cb = ContinuousBatchingConfig(page_size=page, num_blocks=batch * max_len // page,
                                  max_batch_tokens=max(2048, max_len),
                                  max_requests_per_batch=batch, allow_block_sharing=False)

    def run(items):
        with model.continuous_batching_context_manager(
                generation_config=gen, continuous_batching_config=cb, block=True, timeout=5,
                warmup=False) as manager:
            clock = Clock().__enter__()  # from the first request to the last result
            ids = [manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=n,
                                       eos_token_id=-1) for i, (prompt, n) in enumerate(items)]
            results, _ = finished_results(manager, ids)
            clock.__exit__()
        return [list(results[i].generated_tokens) for i in ids], clock

    run([(ids[:8], 4) for ids, _ in work[:2]])  # warm-up
    tokens, clock = run(work)
    return tokens, clock, {"page_size": page}


# -- the race ---------------------------------------------------------------------------------
def race(ckpt: Path, work, batch: int, max_len: int, only=SYSTEMS) -> dict:
    wanted = [n for _, n in work]
    total = sum(wanted)
    runners = {
        "optimized": lambda: ours(ckpt, "paged", "continuous", work, batch, max_len,
                                  tier=OptimizedLLM),
        "paged_continuous": lambda: ours(ckpt, "paged", "continuous", work, batch, max_len),
        "contiguous_static": lambda: ours(ckpt, "contiguous", "static", work, batch, max_len),
        "hf_generate": lambda: hf_generate(ckpt, work, batch),
        "hf_generate_batch": lambda: hf_generate_batch(ckpt, work, batch, max_len),
    }
    results, reference_tokens = {}, None
    for name in only:
        print(f"  running {LABELS[name]} ...", flush=True)
        try:
            tokens, clock, extra = runners[name]()
        except Exception as error:  # report a system that cannot run here, keep the others
            results[name] = {"ok": False, "error": f"{type(error).__name__}: {error}"}
            print(f"    n/a: {results[name]['error']}", flush=True)
            continue
        useful = sum(min(len(t), n) for t, n in zip(tokens, wanted, strict=True))
        if reference_tokens is None:
            reference_tokens = tokens
        same = sum(a == b for a, b in zip(tokens, reference_tokens, strict=True))
        results[name] = {"ok": True, "seconds": clock.wall, "cpu_seconds": clock.cpu,
                         "output_tokens": useful, "expected_output_tokens": total,
                         "tokens_per_s": useful / clock.wall,
                         "tokens_per_cpu_s": useful / clock.cpu,
                         "requests_identical_to_first_system": same, **extra}
        print(f"    {clock.wall:.1f} s ({clock.cpu:.1f} s CPU), {useful / clock.wall:.1f} "
              "output tokens/s", flush=True)
    base = results.get("hf_generate", {})
    for res in results.values():
        if res.get("ok") and base.get("ok"):
            res["ratio_to_hf_generate"] = res["tokens_per_s"] / base["tokens_per_s"]
            res["cpu_ratio_to_hf_generate"] = res["tokens_per_cpu_s"] / base["tokens_per_cpu_s"]
    return results


def matmul_flops(hidden: int, seconds: float = 1.0) -> float:
    """FLOP/s of float32 matrix products on this process's threads, measured now: [256, hidden]
    x [hidden, 4 hidden], the shape of a busy step's MLP, repeated for about `seconds`."""
    a, b = torch.randn(256, hidden), torch.randn(hidden, 4 * hidden)
    a @ b  # warm-up
    calls, began = 0, time.perf_counter()
    while (spent := time.perf_counter() - began) < seconds:
        a @ b
        calls += 1
    return calls * 2 * 256 * hidden * 4 * hidden / spent


def add_compute_floor(results: dict, params: int, flops: float) -> None:
    """Each system's share of the compute floor: the model's FLOPs per output token (2 per
    weight: a multiply and an add; attention left out) x its tokens/s, over the matmul FLOP/s."""
    for res in results.values():
        if res.get("ok"):
            res["compute_floor_share"] = 2 * params * res["tokens_per_s"] / flops


def print_table(results: dict) -> None:
    print(f"\n{'system':42}{'tokens':>8}{'wall s':>8}{'tok/s':>8}{'x gen':>7}"
          f"{'CPU s':>8}{'tok/CPU-s':>10}{'x gen':>7}{'floor':>7}")

    def times(value):
        return "" if value is None else f"{value:.2f}x"

    for name, res in results.items():
        if not res.get("ok"):
            print(f"{LABELS[name]:42}{'n/a':>8}  ({res['error'][:120]})")
            continue
        print(f"{LABELS[name]:42}{res['output_tokens']:8d}{res['seconds']:8.1f}"
              f"{res['tokens_per_s']:8.1f}{times(res.get('ratio_to_hf_generate')):>7}"
              f"{res['cpu_seconds']:8.1f}{res['tokens_per_cpu_s']:10.1f}"
              f"{times(res.get('cpu_ratio_to_hf_generate')):>7}"
              f"{100 * res.get('compute_floor_share', 0):6.1f}%")
    print("tokens: each request's own output tokens; x gen: throughput / transformers generate's;"
          " CPU s: this process's CPU time (all threads); floor: share of the compute floor "
          "(2 x parameters FLOPs per token x tok/s / matmul FLOP/s measured in this run)")


# -- the profile ------------------------------------------------------------------------------
class Timers:
    """Inclusive wall time and call counts of wrapped functions (perf_counter, ~1 us each)."""

    def __init__(self):
        self.seconds, self.calls, self.patched = {}, {}, []

    def timed(self, fn, label: str):
        """fn, with its time and calls added up under label."""
        self.seconds[label], self.calls[label] = 0.0, 0

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start
                self.calls[label] += 1

        return timed

    def wrap(self, owner, attr: str, label: str) -> None:
        original = getattr(owner, attr)
        setattr(owner, attr, self.timed(original, label))
        self.patched.append((owner, attr, original))

    def restore(self) -> None:
        for owner, attr, original in reversed(self.patched):
            setattr(owner, attr, original)


BACKEND_OPS = ("store_kv", "paged_attention", "rms_norm", "rotary", "silu_and_mul", "sample")


@contextmanager
def step_timers():
    """Timers on the engine's public methods and nn.Linear, and a backend whose ops are timed
    (hand it to LLM(backend=...)): the step's seam makes each op a swappable function."""
    from pagedllm.reference import LLMEngine
    from pagedllm.reference.engine import Scheduler
    from pagedllm.reference.ops import REFERENCE_BACKEND

    t = Timers()
    t.wrap(LLMEngine, "step", "step")
    t.wrap(Scheduler, "schedule", "schedule")
    t.wrap(LLMEngine, "execute_model", "execute")
    t.wrap(torch.nn.Linear, "forward", "linear")
    backend = replace(REFERENCE_BACKEND, **{
        op: t.timed(getattr(REFERENCE_BACKEND, op), op) for op in BACKEND_OPS})
    try:
        yield t, backend
    finally:
        t.restore()


def breakdown(seconds: dict, steps: int = 1, scale: float = 1000.0) -> list[tuple[str, float]]:
    """Exclusive shares of the step time (ms per step by default) from inclusive timers."""
    s = seconds
    small = s["rms_norm"] + s["rotary"] + s["silu_and_mul"]
    rows = [
        ("matrix products (nn.Linear: q/k/v/o, MLP, lm_head)", s["linear"]),
        ("paged attention (gather blocks + attention, per sequence)", s["paged_attention"]),
        ("K/V store by slot mapping (one write per layer)", s["store_kv"]),
        ("small ops (RMSNorm + residual, rotary, SiLU-and-mul)", small),
        ("rest of the model (embedding, views, concatenations)",
         s["execute"] - s["linear"] - s["paged_attention"] - s["store_kv"] - small),
        ("sampling (the batched sampler)", s["sample"]),
        ("engine: scheduler", s["schedule"]),
        ("engine: step inputs, update, stop checks, outputs",
         s["step"] - s["schedule"] - s["execute"] - s["sample"]),
    ]
    return [(name, scale * sec / steps) for name, sec in rows]


def print_breakdown(rows: list[tuple[str, float]], total: float, unit: str) -> None:
    for name, value in rows:
        print(f"  {name:58}{value:9.2f} {unit:3}{100 * value / total:6.1f} %")


def profile(ckpt: Path, work, batch: int, max_len: int, steps: int = 12) -> dict:
    """Run the whole workload through (a) step by step with timers on; split the run and a
    window of steady-state decode steps (a full batch decoding) by where the time goes."""
    timers = step_timers()
    t, backend = timers.__enter__()
    llm = LLM(ckpt, kv_layout="paged", batching="continuous", max_num_seqs=batch,
              max_model_len=max_len, block_size=BLOCK_SIZE,
              num_gpu_blocks=batch * max_len // BLOCK_SIZE, backend=backend)
    engine, counters = llm.engine, llm.engine.scheduler.counters
    for i, (ids, n) in enumerate(work):
        engine.add_request(str(i), {"prompt_token_ids": ids},
                           SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    kinds = {"prefill": [0, 0.0], "decode, full batch": [0, 0.0],
             "decode, part batch (queue empty)": [0, 0.0]}
    part_seqs, full_run, window, contexts, prof = 0, 0, None, [], None
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    try:
        while engine.has_unfinished_requests():
            steady = (window is None and full_run >= 3
                      and len(engine.scheduler.running) == batch)
            if steady:
                contexts = [len(g.seqs[0]) for g in engine.scheduler.running]
                before = dict(t.seconds), dict(t.calls)
                for _ in range(steps):
                    engine.step()
                window = ({k: t.seconds[k] - before[0][k] for k in t.seconds},
                          {k: (t.calls[k] - before[1][k]) // steps for k in t.calls})
                with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                    for _ in range(4):
                        engine.step()
                full_run = 0
            prefilled, decoded = counters["prefill_tokens"], counters["decode_tokens"]
            start = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - start
            decoded = counters["decode_tokens"] - decoded
            if counters["prefill_tokens"] > prefilled:
                kind, full_run = "prefill", 0
            elif decoded == batch:
                kind, full_run = "decode, full batch", full_run + 1
            else:
                kind, full_run = "decode, part batch (queue empty)", 0
                part_seqs += decoded
            kinds[kind][0] += 1
            kinds[kind][1] += seconds
        whole = dict(t.seconds)
    finally:
        timers.__exit__(None, None, None)
    total = whole["step"]
    print(f"\n== profile of (a), {torch.get_num_threads()} threads: the whole workload, "
          f"{total:.1f} s in steps (timers on)")
    for kind, (count, sec) in kinds.items():
        extra = (f", {part_seqs / count:.1f} sequences on average"
                 if kind.startswith("decode, part") and count else "")
        print(f"  {kind:34}{count:6d} steps {sec:7.1f} s {100 * sec / total:5.1f} %"
              f"{'' if not count else f'  {1000 * sec / count:6.1f} ms/step'}{extra}")
    run_rows = breakdown(whole, scale=1.0)
    print("  where the whole run's time goes:")
    print_breakdown(run_rows, total, "s")
    result = {"threads": torch.get_num_threads(), "run_seconds_in_steps": total,
              "steps_by_kind": {k: {"steps": c, "seconds": s} for k, (c, s) in kinds.items()},
              "run_breakdown_seconds": dict(run_rows)}
    if window is None:
        print("  (the batch never ran full: no steady-state window)")
        return result
    seconds, calls = window
    step_ms = 1000 * seconds["step"] / steps
    rows = breakdown(seconds, steps)
    print(f"\n  {steps} steady-state decode steps ({batch} sequences, context lengths "
          f"{min(contexts)}-{max(contexts)}, mean {sum(contexts) / len(contexts):.0f}): "
          f"{step_ms:.1f} ms per step")
    print_breakdown(rows, step_ms, "ms")
    keys = ("linear", "paged_attention", "store_kv", "sample")
    print("  calls per step: " + ", ".join(f"{k} {calls[k]}" for k in keys))
    averages = prof.key_averages()
    ops = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
    total_us = sum(e.self_cpu_time_total for e in averages)
    print("\n  torch.profiler, the next 4 steps, top operators by self CPU time:")
    print(f"  {'operator':34}{'calls/step':>11}{'ms/step':>9}{'share':>8}")
    top = []
    for e in ops:
        top.append({"op": e.key, "calls_per_step": e.count / 4,
                    "ms_per_step": e.self_cpu_time_total / 4000,
                    "share": e.self_cpu_time_total / total_us})
        print(f"  {e.key[:34]:34}{e.count / 4:11.0f}{e.self_cpu_time_total / 4000:9.2f}"
              f"{100 * e.self_cpu_time_total / total_us:7.1f}%")
    ops_per_step = sum(e.count for e in averages) / 4
    print(f"  operators dispatched per step: {ops_per_step:.0f}")
    result.update({"steady_steps": steps, "steady_ms_per_step": step_ms,
                   "steady_context_lengths": [min(contexts), max(contexts)],
                   "steady_breakdown_ms_per_step": dict(rows),
                   "steady_calls_per_step": {k: calls[k] for k in keys},
                   "torch_profiler_top": top, "ops_per_step": ops_per_step})
    return result


# -- main -------------------------------------------------------------------------------------
def run(args, size: str, num_requests: int, scale: int, batch: int, max_len: int,
        only: list[str], load: float) -> dict:
    """Write the checkpoint and the workload, then race the systems (or profile (a))."""
    with tempfile.TemporaryDirectory(prefix="pagedllm-throughput-") as tmp:
        if args.model:
            ckpt, params, fields = real_checkpoint(args.model, max_len)
            kind = f"{args.model} (real weights)"
        else:
            ckpt, params = write_checkpoint(Path(tmp), size, max_len)
            fields, kind = MODELS[size], "Llama-style (random weights)"
        work, lengths = make_workload(num_requests, scale, fields["vocab_size"])
        prompts = np.array([len(ids) for ids, _ in work])
        outputs = np.array([n for _, n in work])
        config = {
            "size": size, "model": {**fields, "parameters": params,
                                    "family": "llama", "dtype": "float32"},
            "workload": {"requests": num_requests, "scale": scale, "max_model_len": max_len,
                         "prompt_mean": float(prompts.mean()),
                         "prompt_max": int(prompts.max()),
                         "output_mean": float(outputs.mean()), "output_max": int(outputs.max()),
                         "output_tokens": int(outputs.sum()),
                         "length_model": f"ShareGPT-like log-normal, means "
                                         f"{lengths.prompt_mean:.2f} / {lengths.output_mean:.2f}"
                                         f" (published / {scale}), max_len {max_len}",
                         "arrivals": "all at once (offline)", "ignore_eos": True,
                         "sampling": "greedy"},
            "batch_size": batch, "block_size": BLOCK_SIZE, "kv_slots": batch * max_len,
            "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "load_average_at_start": load, "torch": torch.__version__,
            "python": platform.python_version(),
        }
        print(f"model: {kind}, {params / 1e6:.1f}M parameters "
              f"({', '.join(f'{k}={v}' for k, v in fields.items())}), float32; "
              f"{config['threads']} threads on {os.cpu_count()} CPUs (load average {load:.1f} "
              "at start)")
        w = config["workload"]
        print(f"workload: {num_requests} requests, {w['length_model']}; prompt mean "
              f"{w['prompt_mean']:.1f} (max {w['prompt_max']}), output mean "
              f"{w['output_mean']:.1f} (max {w['output_max']}); {w['output_tokens']} output "
              f"tokens; batch size {batch}, {config['kv_slots']} KV token slots")
        if args.profile:
            results = {"config": config,
                       "profile": profile(ckpt, work, batch, max_len)}
        else:
            import transformers

            config["transformers"] = transformers.__version__
            systems = race(ckpt, work, batch, max_len, only)
            config["matmul_flops"] = matmul_flops(fields["hidden_size"])
            add_compute_floor(systems, params, config["matmul_flops"])
            print_table(systems)
            print(f"matmul: {config['matmul_flops'] / 1e9:.1f} GFLOP/s float32 on "
                  f"{torch.get_num_threads()} thread(s)")
            results = {"config": config, "systems": systems}
    return results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the small size (under 2 minutes)")
    parser.add_argument("--json", type=Path, default=None, help="write all numbers here")
    parser.add_argument("--model", default=None,
                        help="race on a real checkpoint instead of random weights: a name "
                             "(smollm2-135m-instruct), a .gguf file or a folder; "
                             f"{SIZES['model'][0]} requests")
    parser.add_argument("--profile", action="store_true",
                        help="profile steps of (a) instead of running the race")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for every system (default 1; 0: torch's default)")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"comma-separated subset of {','.join(SYSTEMS)}")
    args = parser.parse_args(argv)
    size = "model" if args.model else "quick" if args.quick else "full"
    num_requests, scale, batch = SIZES[size]
    max_len = PAPER_MAX_LEN // scale
    only = [s for s in args.systems.split(",") if s]
    if unknown := set(only) - set(SYSTEMS):
        parser.error(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    threads_before = torch.get_num_threads()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]  # what else the machine was running when we started
    began = time.perf_counter()
    torch.manual_seed(SEED)
    try:
        results = run(args, size, num_requests, scale, batch, max_len, only, load)
    finally:
        torch.set_num_threads(threads_before)  # a caller (the tests) keeps its own setting
    results["run_seconds"] = time.perf_counter() - began
    print(f"\ntotal run time {results['run_seconds']:.0f} s")
    write_json(results, args.json)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
