"""`pagedllm serve --tensor-parallel-size 2`: the server answers, a killed worker turns /health
into 503 and the next request into an error (never a hang), and Ctrl-C ends every process; the
same with `--data-parallel-size 2` on top: two replicas of two ranks each."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
HANG_GUARD_S = 300.0  # only a hang waits this long


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=HANG_GUARD_S) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _complete(url: str, max_tokens: int) -> tuple[int, dict]:
    body = json.dumps({"model": "tiny-pydoc", "prompt": "def add(a, b):",
                       "max_tokens": max_tokens, "temperature": 0}).encode()
    request = urllib.request.Request(url + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=HANG_GUARD_S) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _wait_until_listening(url: str) -> int:
    """The banner comes when the socket is bound; uvicorn accepts a moment later."""
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        try:
            return _get(url)[0]
        except urllib.error.URLError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _start(*flags: str) -> tuple[subprocess.Popen, str]:
    """`pagedllm serve --port 0 FLAGS` on the tiny model, and its URL once it answers."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen(
        [sys.executable, "-m", "pagedllm", "serve", "--port", "0", *flags,
         "--uvicorn-log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    banner = ""
    deadline = time.monotonic() + HANG_GUARD_S
    while "serving" not in banner and time.monotonic() < deadline:
        banner = server.stdout.readline()
        assert banner or server.poll() is None, "the server exited before its banner"
    url = re.search(r"(http://[\d.:]+)/v1", banner).group(1)
    assert _wait_until_listening(url + "/health") == 200
    return server, url


def test_serve_two_ranks_then_lose_one():
    server, url = _start("--tensor-parallel-size", "2")
    try:
        status, body = _complete(url, 8)
        assert status == 200 and body["choices"][0]["text"]
        (worker,) = [p for p in psutil.Process(server.pid).children(recursive=True)
                     if "spawn" in " ".join(p.cmdline())]
        worker.kill()
        worker_gone = time.monotonic() + HANG_GUARD_S  # the signal lands a moment later
        while (status := _get(url + "/health"))[0] == 200 and time.monotonic() < worker_gone:
            time.sleep(0.05)
        status, body = status
        assert status == 503 and "tensor-parallel engine is down" in body["error"]["message"]
        status, body = _complete(url, 8)  # fails at once, and says why
        assert status >= 400, body
        server.send_signal(signal.SIGINT)  # Ctrl-C
        server.wait(60)
    finally:
        leftover = [p for p in psutil.process_iter(["cmdline"])
                    if str(server.pid) in " ".join(p.info["cmdline"] or [])]
        if server.poll() is None:
            server.kill()
    assert server.returncode is not None and not leftover


def test_serve_two_replicas_of_two_ranks():
    """--tensor-parallel-size 2 --data-parallel-size 2: four processes serve (two replicas,
    each rank 0 and its worker), a burst lands on both replicas, and Ctrl-C ends all four."""
    server, url = _start("--tensor-parallel-size", "2", "--data-parallel-size", "2")
    ranks = psutil.Process(server.pid).children(recursive=True)
    try:
        assert len([p for p in ranks if "spawn" in " ".join(p.cmdline())]) == 4, ranks
        results: list = [None] * 6
        def ask(i: int) -> None:
            results[i] = _complete(url, 6)
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(HANG_GUARD_S)
        assert all(status == 200 for status, _ in results), results
        assert len({body["choices"][0]["text"] for _, body in results}) == 1  # greedy, same
        with urllib.request.urlopen(url + "/metrics", timeout=HANG_GUARD_S) as r:
            metrics = r.read().decode()
        done = {engine: float(n) for engine, n in re.findall(
            r'request_success_total\{engine="(\d)",finished_reason="length"[^}]*\} (\S+)',
            metrics)}
        assert sum(done.values()) == 6 and all(done[e] > 0 for e in ("0", "1")), done
        server.send_signal(signal.SIGINT)  # Ctrl-C
        server.wait(60)
    finally:
        if server.poll() is None:
            server.kill()
    psutil.wait_procs(ranks, timeout=30)
    assert server.returncode is not None and not [p for p in ranks if p.is_running()]
