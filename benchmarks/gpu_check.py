"""The one script to run when a GPU is lent: correctness, kernels, end-to-end throughput and the
decode step's share of its memory-bandwidth floor, in one run of under 8 minutes on one H200,
ending with a short table.

From the repository root, with ``pip install -e .`` or with the checkout on PYTHONPATH (a bare
checkout imports as ``pagedllm.<tier>``: ``pagedllm/__init__.py`` searches the checkout's
top-level folders)::

    python benchmarks/gpu_check.py --json /tmp/gpu_check.json    # the whole check
    PYTHONPATH=. python benchmarks/gpu_check.py                  # the same, no install
    python benchmarks/gpu_check.py --quick --skip-tests          # a few minutes less
    python benchmarks/gpu_check.py --dry-run                     # no GPU: every path, ~1 minute

Every subprocess it starts gets the checkout first on PYTHONPATH, so it runs this checkout's
code whatever else is installed.

Sections, each in its own subprocess with a time limit (a crash or a hung CUDA context in one
leaves the others running; the table says which failed):

0. compile: ``python -m pagedllm.kernels.compile_check --matrix ci``: every launch the engine
   makes, recorded under the interpreter and compiled for sm_80 and sm_90 in fresh processes;
   shared memory, registers, spills and occupancy per kernel and target (the same report CI
   checks, run first so that a launch the GPU cannot load is named before anything runs).
1. tests: ``pytest tests/gpu``: the kernels, the reference and the optimized tier on CUDA
   against their CPU or reference twins; passed / failed counts.
2. kernels: ``benchmarks/kernels_gpu.py``; its goal rows (decode attention at context 4096 vs
   a device-to-device copy, prefill at 4096 vs FlashAttention).
3. e2e: throughput on random-weight bfloat16 models shaped like SmolLM2-135M, Qwen2.5-0.5B and
   Llama-3.2-1B (written by ``save_pretrained`` into a temporary folder: nothing downloaded), on
   nano-vllm's benchmark workload: every request queued at once, prompt and output lengths
   uniform in 100..1024, greedy, EOS ignored (each request generates exactly its own length).
   Systems (``systems.py``, the ones ``throughput_cpu.py`` races on the CPU): the optimized
   engine (also on int8 and int4 weights: the Triton W8A16 / W4A16 products), the reference
   engine, transformers ``generate`` on static batches (left-padded; only
   each request's own tokens count) and transformers ``generate_batch`` (its continuous
   batching, each request its own max_new_tokens). All get the same batch size and KV room
   (max_num_seqs x max_model_len tokens). Each is warmed up first (the optimized engine on a
   workload whose batch shrinks through every CUDA-graph size). The table gives useful output
   tokens per second and the ratio to ``generate``.
   Time limits: each system gets a share of its model's time; a system still running at the end
   of it stops and is reported as *partial* (tokens made so far over the time taken; ``generate``
   stops through its ``max_time``; ``generate_batch`` counts finished requests only). A partial
   number leaves out the slow tail of a run, so it flatters the system that was cut off.
4. decode: a steady decode step of the optimized engine (Llama-3.2-1B shape, 64 sequences of
   about 1024 tokens of context): its memory-bandwidth floor is (weight bytes + K/V bytes read)
   / the bandwidth of a large device-to-device copy measured in the same run; the share is
   floor / step time, for the engine's whole step and for the forward alone.
5. parallel: ``benchmarks/parallel_cpu.py`` with tensor_parallel_size 1 and 2 (one GPU per rank,
   NCCL) on the random model: tokens per second, ms per step, the share of a step spent in
   collectives and publishing the step. Runs only where more than one GPU is lent (skipped with
   one); the dry run takes the gloo path on the CPU.

Goals, printed beside the numbers: end-to-end >= 10x transformers generate; decode step >= 70 %
of its bandwidth floor. A missed goal is reported, not failed. Exit status 1 if any section
failed (an exception, a time limit, a failed test), 0 otherwise; 2 without CUDA and without
--dry-run.

``--dry-run`` runs every path on the CPU with tiny shapes of the same configs: the tests (all
skipped without CUDA), the kernel benchmark's own dry run (kernels through Triton's interpreter),
the engines and transformers on the CPU (the optimized tier's CPU fallback), the decode probe;
timing replaced by one call, its numbers are not measurements.
"""

import time

STARTED = time.perf_counter()  # a worker's time limit counts from here: its imports included

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from pagedllm.benchmarks.systems import (  # noqa: E402
    BLOCK_SIZE,
    attempt,
    free_memory,
    hf_generate,
    hf_generate_batch,
    ours,
    sync,
)

ROOT = Path(__file__).resolve().parents[1]

# -- sizes and budgets --------------------------------------------------------------------------
BUDGET_S = {"full": 455.0, "quick": 300.0, "dry": 600.0}  # the whole run; 8 minutes is the limit
# Each section's share of the budget left when it starts (time a section leaves unused goes to
# the sections after it).
WEIGHTS = {"compile": 60, "tests": 150, "kernels": 55, "e2e": 70, "decode": 35, "parallel": 20}
GRACE_S = 8.0  # a worker's time limit beyond its own budget: clean-up

GOAL_E2E = 10.0  # x transformers generate
GOAL_DECODE = 0.70  # share of the bandwidth floor

SEED = 0

# Random-weight models shaped like the published ones (the tiny_config family, then overrides).
MODELS = {
    "smollm2-135m": dict(
        family="llama",
        config=dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, tie_word_embeddings=True, rope_theta=100000.0,
                    max_position_embeddings=8192, rms_norm_eps=1e-5),
        # Tiny shapes keep every input size a multiple of 32, int4's smallest group.
        tiny=dict(vocab_size=512, hidden_size=96, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                  tie_word_embeddings=True, rope_theta=100000.0, max_position_embeddings=4096)),
    "qwen2.5-0.5b": dict(
        family="qwen2",
        config=dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                    num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                    tie_word_embeddings=True, rope_theta=1000000.0,
                    max_position_embeddings=32768, rms_norm_eps=1e-6),
        tiny=dict(vocab_size=512, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=1, tie_word_embeddings=True,
                  rope_theta=1000000.0, max_position_embeddings=4096)),
    "llama-3.2-1b": dict(
        family="llama3",
        config=dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                    num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=64, tie_word_embeddings=True, rope_theta=500000.0,
                    rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                      high_freq_factor=4.0,
                                      original_max_position_embeddings=8192),
                    max_position_embeddings=131072, rms_norm_eps=1e-5),
        tiny=dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                  tie_word_embeddings=True, rope_theta=500000.0,
                  rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                    high_freq_factor=4.0, original_max_position_embeddings=64),
                  max_position_embeddings=4096)),
}
DECODE_MODEL = "llama-3.2-1b"

# The e2e workload (nano-vllm's bench.py: lengths uniform in 100..1024, all queued at once).
E2E = {  # requests (= the batch size: every request runs from the first step), lengths
    "full": dict(requests=64, low=100, high=1024, max_len=2048),
    "quick": dict(requests=32, low=100, high=1024, max_len=2048),
    "dry": dict(requests=6, low=4, high=24, max_len=64, batch=4),
}
# Each system's share of its model's time (what is left after the checkpoint is written).
# optimized_int8 / _int4: the optimized engine on weight-only int8 / int4 (groups of 32)
# weights, its Triton W8A16 / W4A16 products (kernels/quant_linear.py), activations bf16.
SYSTEMS = ("optimized", "optimized_int8", "optimized_int4", "hf_generate", "hf_generate_batch",
           "reference")
SHARES = {"optimized": 0.3, "optimized_int8": 0.1, "optimized_int4": 0.1, "hf_generate": 0.2,
          "hf_generate_batch": 0.2, "reference": 0.1}
# Seconds each system takes on the GPU beside its timed run (loading, warm-up, compiling).
SETUP_S = {"optimized": 10.0, "optimized_int8": 10.0, "optimized_int4": 10.0,
           "hf_generate": 3.0, "hf_generate_batch": 8.0, "reference": 3.0}
# The dry run's limits: three systems run to the end, two stop at once (their partial path).
DRY_CAPS = {"optimized": math.inf, "optimized_int8": math.inf, "optimized_int4": 0.0,
            "hf_generate": 600.0, "hf_generate_batch": 0.0, "reference": 0.0}
LABELS = {"optimized": "optimized engine", "optimized_int8": "optimized engine, int8 weights",
          "optimized_int4": "optimized engine, int4 weights", "reference": "reference engine",
          "hf_generate": "transformers generate", "hf_generate_batch": "transformers gen_batch"}

DECODE = {  # sequences, context tokens, timed steps
    "full": dict(batch=64, context=1024, steps=20, copy_bytes=1 << 30),
    "quick": dict(batch=64, context=1024, steps=10, copy_bytes=1 << 30),
    "dry": dict(batch=4, context=24, steps=1, copy_bytes=1 << 20),
}


# == helpers used by the workers ================================================================
def write_checkpoint(root: Path, name: str, dry_run: bool, device: str) -> Path:
    """The model `name` with N(0, 0.02) weights in bfloat16, written by save_pretrained
    (reused when an earlier worker of this run wrote it)."""
    from transformers import AutoModelForCausalLM

    from pagedllm.reference.model.random_checkpoint import tiny_config
    path = root / name
    if (path / "config.json").exists():
        return path
    spec = MODELS[name]
    cfg = tiny_config(spec["family"], **(spec["tiny"] if dry_run else spec["config"]))
    cfg.initializer_range = 0.02
    torch.manual_seed(SEED)
    with torch.device(device):  # initialised where it runs: seconds on a GPU for 1B weights
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    partial = root / f"{name}.partial-{os.getpid()}"
    model.save_pretrained(partial)
    del model
    free_memory()
    partial.rename(path)
    return path


def checkpoint_weight_bytes(ckpt: Path) -> int:
    """Bytes of the checkpoint's weights, from its safetensors headers (a tied embedding / lm
    head is stored once): what a decode step reads of them."""
    total = 0
    for path in ckpt.glob("*.safetensors"):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        total += sum(t["data_offsets"][1] - t["data_offsets"][0]
                     for name, t in header.items() if name != "__metadata__")
    return total


def make_workload(n: int, low: int, high: int, vocab: int, seed: int = SEED):
    """[(prompt token ids, output length)]: both lengths uniform in low..high."""
    rng = np.random.default_rng(seed)
    eos = vocab - 1  # never in a prompt (EOS is ignored anyway)
    return [(rng.integers(0, eos, int(rng.integers(low, high + 1))).tolist(),
             int(rng.integers(low, high + 1))) for _ in range(n)]


def warmup_workload(batch: int, vocab: int, prompt: int = 32, seed: int = SEED + 1):
    """`batch` requests whose outputs have lengths 1..batch: the decode batch shrinks by one each
    step, through every CUDA-graph size, and the kernels compile for each (outside the timing)."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, vocab - 1, prompt).tolist(), i + 1) for i in range(batch)]


def same_tokens(a: list, b: list) -> dict:
    """How two systems' tokens agree, over the requests both finished: identical requests, and
    the mean share of the shorter output before the first difference."""
    both = [(x, y) for x, y in zip(a, b, strict=True) if x and y]
    if not both:
        return {"compared": 0}
    prefix = []
    for x, y in both:
        n = min(len(x), len(y))
        first = next((i for i in range(n) if x[i] != y[i]), n)
        prefix.append(first / n)
    return {"compared": len(both), "identical": sum(x == y for x, y in both),
            "mean_common_prefix": sum(prefix) / len(prefix)}


# -- the workers ---------------------------------------------------------------------------------
def e2e_worker(args) -> dict:
    """One model: write it, race the systems, write the JSON after each (a worker stopped at
    its time limit still leaves the systems it finished)."""
    began = time.perf_counter()
    mode = "dry" if args.dry_run else "quick" if args.quick else "full"
    deadline = STARTED + args.budget
    size = dict(E2E[mode])
    if args.requests:
        size["requests"] = args.requests
    dev = "cpu" if args.dry_run else "cuda"
    setup = {"device": dev, "dry_run": args.dry_run, "batch": size.get("batch", size["requests"]),
             "max_len": size["max_len"]}
    report = {"model": args.model, "device": dev, "setup": setup, "workload": {}, "systems": {}}

    def save():
        Path(args.worker_out).write_text(json.dumps(report, indent=2))

    ckpt = write_checkpoint(Path(args.ckpt_root), args.model, args.dry_run, dev)
    from pagedllm.reference.model.config import load_config
    cfg = load_config(ckpt)
    work = make_workload(size["requests"], size["low"], size["high"], cfg.vocab_size)
    report["workload"] = {
        "requests": len(work), "prompt_tokens": sum(len(p) for p, _ in work),
        "output_tokens": sum(n for _, n in work), "lengths": f"uniform {size['low']}.."
        f"{size['high']}", "batch": setup["batch"], "max_model_len": setup["max_len"],
        "dtype": "bfloat16", "greedy": True, "ignore_eos": True}
    report["checkpoint_seconds"] = time.perf_counter() - began
    print(f"{args.model}: {len(work)} requests, {report['workload']['output_tokens']} output "
          f"tokens; checkpoint in {report['checkpoint_seconds']:.1f} s", flush=True)
    save()
    from pagedllm.optimized import LLM as OptimizedLLM
    from pagedllm.reference import LLM as ReferenceLLM

    engine_size = dict(batch=setup["batch"], max_len=setup["max_len"], device=dev,
                       dtype="bfloat16")
    hf_size = dict(batch=setup["batch"], device=dev, dtype=torch.bfloat16)
    runners = {
        "optimized": lambda w, c, eager=False: ours(work, OptimizedLLM, ckpt, warm=w, cap=c,
                                                    enforce_eager=eager, **engine_size),
        "optimized_int8": lambda w, c: ours(work, OptimizedLLM, ckpt, warm=w, cap=c,
                                            quantization="int8", **engine_size),
        "optimized_int4": lambda w, c: ours(work, OptimizedLLM, ckpt, warm=w, cap=c,
                                            quantization="int4", **engine_size),
        "reference": lambda w, c: ours(work, ReferenceLLM, ckpt, warm=w, cap=c, **engine_size),
        "hf_generate": lambda w, c: hf_generate(work, ckpt, warm=w, cap=c, **hf_size),
        "hf_generate_batch": lambda w, c: hf_generate_batch(
            work, ckpt, max_len=setup["max_len"], warm=w, cap=c, **hf_size)}
    tokens_of = {}
    for i, name in enumerate(SYSTEMS):
        left = deadline - time.perf_counter()
        rest = SYSTEMS[i:]
        share = SHARES[name] / sum(SHARES[s] for s in rest)
        setup_s = sum(SETUP_S[s] for s in rest)
        cap = DRY_CAPS[name] if args.dry_run else max(2.0, (left - setup_s) * share)
        if name.startswith("optimized"):  # every CUDA-graph size
            warm = warmup_workload(setup["batch"], cfg.vocab_size)
        elif name == "reference":
            warm = warmup_workload(4, cfg.vocab_size, prompt=16)
        else:
            warm = warmup_workload(2, cfg.vocab_size, prompt=8)
        print(f"  {LABELS[name]} (time limit {cap:.0f} s) ...", flush=True)
        result, tokens = attempt(partial(runners[name], warm, cap), work)
        if not result["ok"] and name == "optimized" and not args.dry_run:
            # CUDA graphs failing would fail every decode step: measure eagerly, still failed
            left = deadline - time.perf_counter()
            eager, tokens = attempt(partial(runners[name], warm,
                                            max(2.0, (left - setup_s) * share), eager=True), work)
            if eager["ok"]:
                result.update({k: v for k, v in eager.items() if k != "ok"}, eager_fallback=True)
            else:
                result["eager_error"] = eager["error"]
        if tokens is not None:
            tokens_of[name] = tokens
            if "optimized" in tokens_of and name != "optimized":
                result["agreement_with_optimized"] = same_tokens(tokens_of["optimized"], tokens)
        report["systems"][name] = result
        if result.get("tokens_per_s") is not None:
            print(f"    {result['output_tokens']} tokens in {result['seconds']:.1f} s: "
                  f"{result['tokens_per_s']:.0f} tok/s{' (partial)' if result['partial'] else ''}",
                  flush=True)
        else:
            print(f"    failed: {result['error'][:300]}", flush=True)
        save()
    base = report["systems"].get("hf_generate", {})
    for res in report["systems"].values():
        if res.get("tokens_per_s") and base.get("tokens_per_s"):
            res["ratio_to_generate"] = res["tokens_per_s"] / base["tokens_per_s"]
    report["seconds"] = time.perf_counter() - began
    save()
    return report


def copy_bandwidth(nbytes: int, device: str, reps: int) -> float:
    """Bytes per second of a device-to-device copy, read + written (the memory system's own
    number, as kernels_gpu.py measures it): the median of `reps` copies."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    for _ in range(min(reps, 3)):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t)
    times.sort()
    del src, dst
    return 2 * nbytes / times[len(times) // 2]


def decode_probe(ckpt: Path, setup: dict, enforce_eager: bool) -> dict:
    """Time steady decode steps of the optimized engine: `batch` sequences of `context` prompt
    tokens, all prefilled, then `steps` decode steps (after warm-up steps that capture the
    graph); then the forward alone on the last step's inputs."""
    from pagedllm.optimized import LLM
    from pagedllm.optimized.cuda_graphs import CudaGraphs
    from pagedllm.reference import SamplingParams
    from pagedllm.reference.model.config import load_config

    dev, batch, context, steps = (setup["device"], setup["batch"], setup["context"],
                                  setup["steps"])
    warm_steps = 0 if setup["dry_run"] else 3
    new = warm_steps + steps + 8
    max_len = context + new
    llm = LLM(ckpt, dtype="bfloat16", device=dev, block_size=BLOCK_SIZE,
              num_gpu_blocks=batch * -(-max_len // BLOCK_SIZE), max_num_seqs=batch,
              max_model_len=max_len, enforce_eager=enforce_eager)
    engine = llm.engine
    cfg = load_config(ckpt)
    rng = np.random.default_rng(SEED)
    for i in range(batch):
        engine.add_request(f"d{i}", {"prompt_token_ids": rng.integers(
            0, cfg.vocab_size - 1, context).tolist()},
            SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))
    made = {}
    while len(made) < batch or min(made.values()) < 1 or llm.stats()["waiting"]:
        for out in engine.step():  # the prefills (and a few decodes of the first prompts)
            made[out.request_id] = len(out.outputs[0].token_ids)
    for _ in range(warm_steps):
        engine.step()
    seen = []
    engine.add_step_observer(lambda eng, sched, inputs: seen.append(inputs))
    sync(dev)
    began = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(dev)
    step_s = (time.perf_counter() - began) / steps
    assert all(i.input_ids.shape[0] == batch for i in seen), "not a steady decode batch"
    context_tokens = sum(int(i.attn_metadata.seq_lens_cpu.sum()) for i in seen) / len(seen)
    # The model runner, the one part of the engine used directly: the forward alone, and the
    # decode batch sizes it captured as CUDA graphs.
    runner = engine.runner
    sync(dev)
    began = time.perf_counter()
    for _ in range(steps):  # the same step again: the same K/V rewritten in the same slots
        runner.execute(seen[-1])
    sync(dev)
    forward_s = (time.perf_counter() - began) / steps
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.bfloat16.itemsize
    return {"batch": batch, "mean_context": context_tokens / batch,
            "weight_bytes": checkpoint_weight_bytes(ckpt),
            "kv_bytes": context_tokens * kv_per_token, "step_s": step_s,
            "forward_s": forward_s, "enforce_eager": enforce_eager,
            "graphs": sorted(runner.whole_step.graphs)
            if isinstance(runner.whole_step, CudaGraphs) else []}


def decode_worker(args) -> dict:
    began = time.perf_counter()
    mode = "dry" if args.dry_run else "quick" if args.quick else "full"
    dev = "cpu" if args.dry_run else "cuda"
    setup = {**DECODE[mode], "device": dev, "dry_run": args.dry_run}
    report = {"model": DECODE_MODEL, "setup": setup}
    ckpt = write_checkpoint(Path(args.ckpt_root), DECODE_MODEL, args.dry_run, dev)
    bandwidth = copy_bandwidth(setup["copy_bytes"], dev, 1 if args.dry_run else 10)
    report["copy_bytes_per_s"] = bandwidth
    probe, error = None, None
    try:
        probe = decode_probe(ckpt, setup, enforce_eager=False)
    except Exception as exc:
        if args.dry_run:
            raise
        traceback.print_exc()
        error = f"{type(exc).__name__}: {exc}"
    if probe is None:  # CUDA graphs failing: measure eagerly (the section still fails)
        report["error"] = error
        free_memory()
        probe = decode_probe(ckpt, setup, enforce_eager=True)
    floor_s = (probe["weight_bytes"] + probe["kv_bytes"]) / bandwidth
    report.update(probe, floor_s=floor_s, step_share=floor_s / probe["step_s"],
                  forward_share=floor_s / probe["forward_s"],
                  seconds=time.perf_counter() - began)
    Path(args.worker_out).write_text(json.dumps(report, indent=2))
    print(f"decode: step {1e3 * probe['step_s']:.2f} ms, forward {1e3 * probe['forward_s']:.2f}"
          f" ms, floor {1e3 * floor_s:.2f} ms", flush=True)
    if "error" in report:
        raise RuntimeError(f"CUDA graphs failed, measured eagerly: {report['error']}")
    return report


# == the orchestrator ===========================================================================
class Run:
    """The sections' rows, failures, budget and logs."""

    def __init__(self, args):
        self.args = args
        self.mode = "dry" if args.dry_run else "quick" if args.quick else "full"
        self.began = time.perf_counter()
        self.budget = args.budget or BUDGET_S[self.mode]
        self.rows: list[dict] = []
        self.failures: list[str] = []
        self.sections: dict[str, dict] = {}
        self.log = None
        if args.log:
            Path(args.log).parent.mkdir(parents=True, exist_ok=True)
            self.log = open(args.log, "w")

    def elapsed(self) -> float:
        return time.perf_counter() - self.began

    def limit(self, weight: float, weights_left: float) -> float:
        """This section's seconds: its share of what is left of the budget."""
        left = self.budget - self.elapsed()
        return max(20.0, left * weight / weights_left)

    def child(self, name: str, cmd: list[str], timeout: float) -> tuple[int | None, str]:
        """Run a subprocess (pytest, the kernel benchmark, this script's workers) on this
        checkout with a time limit; (exit status or None when it ran out of time, its output)."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
        env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
        print(f"[{self.elapsed():5.0f} s] {name}: running (limit {timeout:.0f} s)", flush=True)
        began = time.perf_counter()
        # Its own process group: at the time limit the child goes with everything it started
        # (pytest-xdist's workers, say), so nothing is left running on the GPU.
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            rc = None
        seconds = time.perf_counter() - began
        if self.log:
            self.log.write(f"\n===== {name}: exit {rc}, {seconds:.1f} s =====\n{out}")
            self.log.flush()
        status = "ran out of time" if rc is None else f"exit {rc}"
        print(f"[{self.elapsed():5.0f} s] {name}: {status} after {seconds:.0f} s", flush=True)
        if rc != 0:
            tail = "\n".join(out.rstrip().splitlines()[-25:])
            print(f"--- last lines of {name} ---\n{tail}\n---", flush=True)
        return rc, out

    def fail(self, what: str) -> None:
        self.failures.append(what)

    def row(self, section, item, result, goal="", status="ok"):
        self.rows.append(dict(section=section, item=item, result=result, goal=goal,
                              status=status))


def python(*args) -> list[str]:
    """A new interpreter running args (-S again if this one ignores site: a test of a plain
    checkout, no installed pagedllm)."""
    return [sys.executable, *(["-S"] if sys.flags.no_site else []), *map(str, args)]


def this_script(*args) -> list[str]:
    return python(Path(__file__).resolve(), *args)


def section_tests(run: Run, timeout: float) -> None:
    # pytest-xdist, where installed, spreads the tests (and their Triton compiles) over processes
    xdist = not run.args.dry_run and importlib.util.find_spec("xdist") is not None
    cmd = python("-m", "pytest", "tests/gpu", "-q", "-o", "addopts=", "-p", "no:cacheprovider",
                 "-rfE", *(["-n", "4"] if xdist else []))
    rc, out = run.child("tests", cmd, timeout)
    counts = {}
    summary = next((line for line in reversed(out.splitlines())
                    if re.search(r"\d+ (passed|failed|errors?|skipped)", line)), "")
    for n, kind in re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)", summary):
        counts[kind.rstrip("s") if kind.startswith("error") else kind] = int(n)
    failed = [line.split(" ")[1] for line in out.splitlines()
              if line.startswith(("FAILED ", "ERROR "))]
    run.sections["tests"] = {"exit": rc, "counts": counts, "failed": failed}
    text = ", ".join(f"{counts.get(k, 0)} {k}" for k in ("passed", "failed", "error", "skipped"))
    if rc is None:
        text = "ran out of time; " + text
    ok = rc == 0
    if not ok:
        run.fail(f"tests: {text}" + (f" ({', '.join(failed[:5])}"
                                      f"{' ...' if len(failed) > 5 else ''})" if failed else ""))
    run.row("tests", "pytest tests/gpu", text, status="ok" if ok else "FAILED")
    for name in failed[:8]:
        run.row("tests", "  " + name.split("::", 1)[-1][:44], "failed", status="FAILED")


def section_compile(run: Run, timeout: float, tmp: Path) -> None:
    """The compile report first: every launch the engine makes, recorded under the interpreter
    and compiled for sm_80 and sm_90 in fresh processes, with shared memory and registers
    against the SM's limits (kernels/compile_check.py). The dry run walks the path on one engine
    run, for sm_90 only (CI's own compile test covers the matrix)."""
    report = tmp / "compile_check.json"
    targets, matrix = ("90", "smoke") if run.args.dry_run else ("80,90", "ci")
    cmd = python("-m", "pagedllm.kernels.compile_check", "--matrix", matrix, "--targets",
                 targets, "--json", report)
    rc, out = run.child("compile", cmd, timeout)
    data = json.loads(report.read_text()) if report.exists() else {}
    run.sections["compile"] = {"exit": rc, "summary": data.get("summary", [])}
    if data.get("summary"):
        from pagedllm.kernels.compile_check import format_summary

        print(format_summary(data["summary"]), flush=True)  # the resource table
    ok = rc == 0
    if not ok:
        run.fail("compile: " + ("ran out of time" if rc is None else f"exit {rc}"))
    run.row("compile", f"compile_check --targets {targets}",
            f"{len(data.get('results', []))} (launch, target) pairs", status="ok" if ok
            else "FAILED")


def section_kernels(run: Run, timeout: float, tmp: Path) -> None:
    report = tmp / "kernels_gpu.json"
    cmd = python(ROOT / "benchmarks" / "kernels_gpu.py", "--json", report,
                 *(["--dry-run"] if run.args.dry_run else []))
    rc, out = run.child("kernels", cmd, timeout)
    data = json.loads(report.read_text()) if report.exists() else {}
    run.sections["kernels"] = {"exit": rc, **data}
    goal_rows = [r for r in data.get("rows", []) if r.get("goal") is not None]
    for r in goal_rows:
        ratio = r["ours"] / r["baseline"] if r.get("ours") and r.get("baseline") else None
        if ratio is None:
            run.row("kernels", r["case"], "-", f">= {r['goal']:.2f}", "-")
            continue
        run.row("kernels", r["case"], f"{r['ours']:.0f} {r['unit']} = {ratio:.2f} of "
                f"{r['baseline']:.0f}", f">= {r['goal']:.2f}",
                "met" if ratio >= r["goal"] else "MISSED")
    if not goal_rows:
        rows = len(data.get("rows", []))
        run.row("kernels", "kernels_gpu.py", f"{rows} rows" + (" (dry run: no goal rows)"
                                                                if run.args.dry_run else ""),
                status="ok" if rc == 0 else "FAILED")
    if rc != 0:
        why = "; ".join(data.get("failures", [])[:3]) or (
            "ran out of time" if rc is None else f"exit {rc}")
        run.fail(f"kernels: {why}")
        if goal_rows:
            run.row("kernels", "kernels_gpu.py", why[:60], status="FAILED")


def worker_cmd(run: Run, kind: str, out: Path, budget: float, tmp: Path, model: str = ""):
    args = ["--worker", kind, "--worker-out", out, "--budget", f"{budget:.0f}",
            "--ckpt-root", tmp / "checkpoints"]
    if model:
        args += ["--model", model]
    if run.args.dry_run:
        args.append("--dry-run")
    if run.args.quick:
        args.append("--quick")
    if run.args.requests:
        args += ["--requests", run.args.requests]
    return this_script(*args)


def section_e2e(run: Run, model: str, timeout: float, tmp: Path) -> None:
    out = tmp / f"e2e-{model}.json"
    rc, _ = run.child(f"e2e {model}", worker_cmd(run, "e2e", out, timeout - GRACE_S, tmp, model),
                      timeout)
    data = json.loads(out.read_text()) if out.exists() else {}
    run.sections[f"e2e {model}"] = {"exit": rc, **data}
    systems = data.get("systems", {})
    if data.get("workload"):
        w = data["workload"]
        run.row("e2e", f"{model}: {w['requests']} req, {w['output_tokens']} out tok", "")
    for name in SYSTEMS:
        res = systems.get(name)
        goal = f">= {GOAL_E2E:.0f}x gen" if name == "optimized" else ""
        if res is None:
            run.row("e2e", f"  {LABELS[name]}", "not run", goal, "FAILED")
            continue
        if res.get("tokens_per_s") is None:
            run.row("e2e", f"  {LABELS[name]}", res.get("error", "?")[:60], goal, "FAILED")
            continue
        ratio = res.get("ratio_to_generate")
        text = f"{res['tokens_per_s']:8.0f} tok/s"
        if ratio is not None:
            text += f" = {ratio:5.2f}x gen"
        notes = [n for n, on in (("partial", res.get("partial")),
                                 ("eager fallback", res.get("eager_fallback"))) if on]
        if notes:
            text += f" ({', '.join(notes)})"
        status = "ok"
        if name == "optimized" and ratio is not None and not run.args.dry_run:
            status = "met" if ratio >= GOAL_E2E else "MISSED"
        if not res.get("ok"):
            status = "FAILED"
        run.row("e2e", f"  {LABELS[name]}", text, goal, status)
    errors = [f"{name}: {res['error']}" for name, res in systems.items() if not res.get("ok")]
    missing = [n for n in SYSTEMS if n not in systems]
    if rc != 0 or errors or missing:
        why = "; ".join(errors)[:300] or ("ran out of time" if rc is None else f"exit {rc}")
        run.fail(f"e2e {model}: {why}" + (f" (not run: {', '.join(missing)})" if missing else ""))


def section_parallel(run: Run, timeout: float, tmp: Path) -> None:
    """tensor_parallel_size 1 vs 2 (``parallel_cpu.py``): on two GPUs (NCCL) where more than one
    is lent; the dry run takes the same path on the CPU (gloo); with one GPU, skipped."""
    if not run.args.dry_run and torch.cuda.device_count() < 2:
        run.row("parallel", "tensor_parallel_size 2", "skipped: one GPU")
        return
    report = tmp / "parallel.json"
    cmd = python(ROOT / "benchmarks" / "parallel_cpu.py", "--models", "random", "--json", report,
                 *(["--quick"] if run.args.dry_run else ["--device", "cuda"]),
                 "--root", tmp / "checkpoints")
    rc, _ = run.child("parallel", cmd, timeout)
    data = json.loads(report.read_text()) if report.exists() else {}
    run.sections["parallel"] = {"exit": rc, **data}
    for row in data.get("random", []):
        run.row("parallel", f"random model, tensor_parallel_size {row['tp']}",
                f"{row['tok_s']:.0f} tok/s, {row['ms_per_step']:.1f} ms/step, comm "
                f"{row['comm_share']:.0%}")
    if rc != 0:
        run.fail(f"parallel: {'ran out of time' if rc is None else f'exit {rc}'}")
        run.row("parallel", "parallel_cpu.py", "failed", status="FAILED")


def section_decode(run: Run, timeout: float, tmp: Path) -> None:
    out = tmp / "decode.json"
    rc, _ = run.child("decode", worker_cmd(run, "decode", out, timeout - GRACE_S, tmp), timeout)
    data = json.loads(out.read_text()) if out.exists() else {}
    run.sections["decode"] = {"exit": rc, **data}
    if not data.get("step_s"):
        run.row("decode", DECODE_MODEL, "no measurement", f">= {GOAL_DECODE:.0%}", "FAILED")
        run.fail(f"decode: {'ran out of time' if rc is None else f'exit {rc}'}")
        return
    gb = (data["weight_bytes"] + data["kv_bytes"]) / 1e9
    eager = " (eager)" if data.get("enforce_eager") else ""
    judged = not run.args.dry_run
    share = data["step_share"]
    run.row("decode", f"{DECODE_MODEL} {data['batch']} x {data['mean_context']:.0f} ctx, "
            f"step{eager}", f"{1e3 * data['step_s']:.2f} ms; floor {1e3 * data['floor_s']:.2f}"
            f" ms = {share:.0%}", f">= {GOAL_DECODE:.0%}",
            ("met" if share >= GOAL_DECODE else "MISSED") if judged else "-")
    run.row("decode", f"  forward alone{eager}", f"{1e3 * data['forward_s']:.2f} ms = "
            f"{data['forward_share']:.0%} of floor")
    run.row("decode", "  floor", f"{gb:.2f} GB at {data['copy_bytes_per_s'] / 1e12:.2f} TB/s "
            "(copy)")
    if rc != 0:
        run.fail(f"decode: {data.get('error', f'exit {rc}')}")
        run.rows[-3]["status"] = "FAILED"


def print_table(run: Run, device: str) -> None:
    mode = {"dry": "DRY RUN on the CPU: numbers are one call each, not measurements",
            "quick": "quick", "full": "full"}[run.mode]
    print(f"\n== gpu_check: {device}; torch {torch.__version__}; {mode}; "
          f"{run.elapsed():.0f} s ==")
    header = f"{'section':9}{'item':46}{'result':44}{'goal':13}status"
    print(header)
    print("-" * len(header))
    for r in run.rows:
        print(f"{r['section']:9}{r['item'][:45]:46}{r['result'][:43]:44}{r['goal']:13}"
              f"{r['status']}")
    print("-" * len(header))
    for failure in run.failures:
        print(f"FAILED {failure[:300]}")
    print(f"gpu_check: {len(run.failures)} section(s) failed; "
          f"{'exit 1' if run.failures else 'exit 0'}")


def orchestrate(args) -> int:
    if not args.dry_run and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    import pagedllm.reference
    where = Path(pagedllm.reference.__file__).resolve()
    if ROOT not in where.parents:
        print(f"pagedllm.reference comes from {where}, not this checkout {ROOT}", file=sys.stderr)
        return 2
    device = "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name()
    run = Run(args)
    print(f"gpu_check: {device}; pagedllm.reference from {where.parent}; budget "
          f"{run.budget:.0f} s", flush=True)
    models = [m for m in (args.models or ",".join(MODELS)).split(",") if m]
    plan = [("compile", WEIGHTS["compile"])]
    if not args.skip_tests:
        plan.append(("tests", WEIGHTS["tests"]))
    plan.append(("kernels", WEIGHTS["kernels"]))
    plan += [(f"e2e {m}", WEIGHTS["e2e"]) for m in models]
    plan.append(("decode", WEIGHTS["decode"]))
    plan.append(("parallel", WEIGHTS["parallel"]))
    with tempfile.TemporaryDirectory(prefix="pagedllm-gpu-check-") as tmp:
        tmp = Path(tmp)
        (tmp / "checkpoints").mkdir()
        for i, (name, weight) in enumerate(plan):
            timeout = run.limit(weight, sum(w for _, w in plan[i:]))
            try:
                if name == "compile":
                    section_compile(run, timeout, tmp)
                elif name == "tests":
                    section_tests(run, timeout)
                elif name == "kernels":
                    section_kernels(run, timeout, tmp)
                elif name.startswith("e2e "):
                    section_e2e(run, name[4:], timeout, tmp)
                elif name == "parallel":
                    section_parallel(run, timeout, tmp)
                else:
                    section_decode(run, timeout, tmp)
            except Exception as exc:  # the orchestrator's own bug: the other sections still run
                traceback.print_exc()
                run.fail(f"{name}: {type(exc).__name__}: {exc}")
                run.row(name.split(" ")[0], name, f"{type(exc).__name__}", status="FAILED")
    if args.json:
        report = dict(device=device, torch=torch.__version__, python=platform.python_version(),
                      mode=run.mode, seconds=run.elapsed(), failures=run.failures,
                      goals={"e2e_x_generate": GOAL_E2E, "decode_floor_share": GOAL_DECODE},
                      rows=run.rows, sections=run.sections)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    if run.log:
        run.log.close()
        print(f"wrote {args.log}")
    print_table(run, device)
    return 1 if run.failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write every number here")
    parser.add_argument("--log", help="write every subprocess's output here (default: beside "
                                      "--json, .log)")
    parser.add_argument("--dry-run", action="store_true",
                        help="on the CPU, tiny shapes, every path once (about a minute)")
    parser.add_argument("--skip-tests", action="store_true", help="leave out pytest tests/gpu")
    parser.add_argument("--quick", action="store_true",
                        help=f"{E2E['quick']['requests']} requests per model instead of "
                             f"{E2E['full']['requests']}, a {BUDGET_S['quick']:.0f} s budget")
    parser.add_argument("--models", help=f"comma-separated subset of {','.join(MODELS)}")
    parser.add_argument("--requests", type=int, help="e2e requests per model (the batch size)")
    parser.add_argument("--budget", type=float,
                        help="seconds for the whole run (default: full "
                             f"{BUDGET_S['full']:.0f}, quick {BUDGET_S['quick']:.0f})")
    # a worker's own arguments (this script starts its workers)
    parser.add_argument("--worker", choices=("e2e", "decode"), help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt-root", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.models and (unknown := set(args.models.split(",")) - set(MODELS) - {""}):
        parser.error(f"unknown models {sorted(unknown)}; choose from {', '.join(MODELS)}")
    if args.worker:
        if args.dry_run:
            torch.set_num_threads(1)  # a shared CPU: one thread each, no waiting on the other
        worker = e2e_worker if args.worker == "e2e" else decode_worker
        worker(args)
        return 0
    if args.json and not args.log:
        args.log = str(Path(args.json).with_suffix(".log"))
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
