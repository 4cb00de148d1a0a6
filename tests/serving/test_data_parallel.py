"""Two data-parallel replicas behind one server (``--data-parallel-size 2``): a burst is served
with nothing lost and each answer equal to the request run alone, the requests spread over both
replicas, a client that hangs up frees the blocks of the replica that held it, the metrics add
up per replica and in total, and a replica that dies fails only its own requests (its gauges
fall to 0). Before that: a replica that cannot load gives `pagedllm serve` the one-line error
it gives without replicas, one killed while loading is named with its exit code, each replica
gets GPUs of its own or none is started, and a call a replica cannot unpickle fails alone."""

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from pagedllm.reference.engine.client import EngineClient
from pagedllm.reference.engine.sampling_params import SamplingParams
from pagedllm.serving.api_server import ServerThread, build_app
from pagedllm.serving.args import add_serve_arguments
from pagedllm.serving.data_parallel import DataParallelEngine, DataParallelLLM, replica_devices
from pagedllm.serving.metrics import ServerMetrics

from .conftest import HANG_GUARD_S, MODEL, wait_for
from .test_concurrency import request

ROOT = Path(__file__).resolve().parents[2]


def serve_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(["--data-parallel-size", "2", "--num-gpu-blocks-override", "64",
                              *flags])


@pytest.fixture(scope="module")
def replicas():
    with DataParallelLLM(serve_args()) as llm:
        yield llm


@pytest.fixture(scope="module")
def server(replicas):
    engine = DataParallelEngine(replicas.replicas, ServerMetrics(MODEL))
    with ServerThread(build_app(engine, MODEL, root=replicas.model_dir)) as running:
        yield running


def metric(server, name: str, **labels) -> dict[str, float]:
    """engine label -> value of ``pagedllm:NAME`` with these labels, from GET /metrics."""
    text = httpx.get(server.url + "/metrics").text
    found = {}
    for line in text.splitlines():
        if line.startswith(f"pagedllm:{name}{{"):
            got = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
            if all(got.get(k) == v for k, v in labels.items()):
                found[got["engine"]] = float(line.rsplit(" ", 1)[1])
    return found


def idle(server) -> dict:
    def holds_none() -> bool:
        s = server.app.state.engine.stats
        return s["running"] == s["waiting"] == s["swapped"] == 0
    wait_for(holds_none, "both replicas holding no request")
    return server.app.state.engine.stats


def test_a_burst_spreads_over_both_replicas_and_nothing_is_lost(server, reference_llm):
    before = {r: sum(metric(server, "request_success_total", finished_reason=r).values())
              for r in ("stop", "length")}
    tokens_before = sum(metric(server, "generation_tokens_total").values())
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                                timeout=120)

    async def one(i: int) -> str:
        if i % 2:  # half streamed, half in one body
            text = ""
            async for chunk in await client.completions.create(model=MODEL, stream=True,
                                                               **request(i)):
                text += chunk.choices[0].text if chunk.choices else ""
            return text
        return (await client.completions.create(model=MODEL, **request(i))).choices[0].text

    async def everyone():
        try:
            return await asyncio.gather(*(one(i) for i in range(24)))
        finally:
            await client.close()

    texts = asyncio.run(everyone())
    tokens = 0
    for i, text in enumerate(texts):
        r = request(i)
        alone = reference_llm.generate([r.pop("prompt")], SamplingParams(**r),
                                       use_tqdm=False)[0].outputs[0]
        assert text == alone.text, f"request {i}"
        tokens += len(alone.token_ids)
    stats = idle(server)
    assert stats["blocks_used"] == 0 and stats["data_parallel_size"] == 2
    assert stats["decode_tokens"] == sum(s["decode_tokens"] for s in stats["replicas"])
    finished = metric(server, "request_success_total", finished_reason="stop")
    length = metric(server, "request_success_total", finished_reason="length")
    per_replica = {e: finished[e] + length[e] for e in finished}
    assert sum(per_replica.values()) - sum(before.values()) == 24  # the totals add up
    assert all(n >= 6 for n in per_replica.values()), per_replica  # both took a share
    assert sum(metric(server, "generation_tokens_total").values()) - tokens_before == tokens


def test_structured_outputs_cross_to_the_replicas(server):
    """The request's SamplingParams (a JSON schema here) travel to the replica by pickle; the
    grammar is compiled and applied there."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                                timeout=120)
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}

    async def both():  # at once: one on each replica
        try:
            return await asyncio.gather(*(client.completions.create(
                model=MODEL, prompt="The with statement", max_tokens=40, seed=seed,
                extra_body={"response_format": fmt}) for seed in range(2)))
        finally:
            await client.close()

    for out in asyncio.run(both()):
        assert out.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(out.choices[0].text)["n"], int)


def test_the_replicas_max_logprobs_reaches_the_front_end(server):
    """The front end resolves prompt_logprobs -1 against the replicas' max_logprobs (20 by
    default: refused by name); the replica refuses 21 at its door; both are 400s."""
    assert server.app.state.engine.limits.max_logprobs == 20
    for body, field in (({"prompt_logprobs": -1}, "prompt_logprobs"),
                        ({"logprobs": 21, "echo": True}, "logprobs")):
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": "The with statement", "max_tokens": 1,
                             **body})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field
        assert "max_logprobs = 20" in r.json()["error"]["message"]


def test_a_client_that_leaves_frees_the_blocks_of_its_replica(server):
    decoded = [s["decode_tokens"] for s in idle(server)["replicas"]]
    aborted = metric(server, "request_success_total", finished_reason="abort")
    long = {"model": MODEL, "prompt": "The for statement is used to", "max_tokens": 900,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/v1/completions", json=long) as r:
            got = 0
            for line in r.iter_lines():  # read a few events, then hang up
                got += line.startswith("data: {")
                if got == 3:
                    break
            holding = [i for i, s in enumerate(server.app.state.engine.stats["replicas"])
                       if s["blocks_used"] > 0]
            assert len(holding) == 1  # one replica holds the request's blocks
    (owner,) = holding
    other = str(1 - owner)
    wait_for(lambda: metric(server, "request_success_total",
                            finished_reason="abort")[str(owner)] > aborted[str(owner)],
             "the abort on the replica that held the request")
    stats = idle(server)
    assert stats["blocks_used"] == 0
    # stopped long before its 900 tokens
    assert stats["replicas"][owner]["decode_tokens"] - decoded[owner] < 300
    after = metric(server, "request_success_total", finished_reason="abort")
    assert after[str(owner)] == aborted[str(owner)] + 1 and after[other] == aborted[other]


@pytest.mark.parametrize("size, match", [(0, ">= 1"), (-1, ">= 1")])
def test_bad_sizes_are_refused_before_any_process_starts(size, match):
    with pytest.raises(ValueError, match=match):
        DataParallelLLM(serve_args("--data-parallel-size", str(size)))


def serve_cli(*flags: str) -> subprocess.Popen:
    """`pagedllm serve --port 0 FLAGS` (the tiny model), its stderr piped."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "pagedllm", "serve", "--port", "0",
                             "--uvicorn-log-level", "warning", *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT)


def ended(server: subprocess.Popen) -> tuple[int, str]:
    """(exit code, stderr) of a serve that must end by itself."""
    try:
        _, stderr = server.communicate(timeout=HANG_GUARD_S)
    finally:
        if server.poll() is None:  # only a hang gets here
            server.kill()
            server.wait()
    return server.returncode, stderr


@pytest.mark.parametrize("flags", [("--model", "{tmp}/no-such-model"), ("--block-size", "0")],
                         ids=["missing-model", "bad-option"])
def test_a_replica_that_cannot_load_gives_the_one_line_error_of_serve_alone(flags, tmp_path):
    """The replica's ValueError crosses the pipe as a ValueError: exit code 2 and the same
    single line (the engine's argument name turned into the flag) as without replicas."""
    flags = [flag.format(tmp=tmp_path) for flag in flags]
    alone = ended(serve_cli(*flags))
    assert alone[0] == 2 and alone[1].startswith("error: ") and alone[1].count("\n") == 1, alone
    assert ended(serve_cli("--data-parallel-size", "2", *flags)) == alone


def _cmdline(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:  # ended meanwhile
        return ""


def test_a_replica_killed_while_loading_is_named_with_its_exit_code():
    """A replica that dies without a word (SIGKILL here, as the OOM killer sends it) closes its
    pipe: the front end names it and its exit code, ends the other replica and exits. The kill
    comes as soon as both replica processes exist, seconds before either can have loaded the
    model (no ready message is possible before that: the banner would come instead)."""
    server = serve_cli("--data-parallel-size", "2")
    front = psutil.Process(server.pid)

    def replicas() -> list[psutil.Process]:
        if server.poll() is not None:
            return []
        return [p for p in front.children() if "spawn_main" in _cmdline(p)]

    started: list[psutil.Process] = []
    try:
        wait_for(lambda: server.poll() is not None or len(replicas()) == 2,
                 "the two replica processes")
        started = replicas()
        assert len(started) == 2, "serve ended before starting its replicas"
        started[1].kill()
        try:
            code, stderr = ended(server)
        except subprocess.TimeoutExpired:
            raise AssertionError("serve went on: had the replica loaded before the kill?") \
                from None
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        for process in started:
            if process.is_running():
                process.kill()
    assert code == 1 and "EOFError" not in stderr, stderr  # a RuntimeError, with its traceback
    assert re.search(r"^RuntimeError: data-parallel replica [01] died while loading the model "
                     r"\(exit code -9\)$", stderr, re.M), stderr
    _, alive = psutil.wait_procs(started, timeout=HANG_GUARD_S)
    assert not alive  # the other replica was ended by the front end


@pytest.mark.parametrize("device, gpus, size, tp, expected", [
    ("auto", [], 2, 1, ("cpu", [None, None])),  # no GPU (this machine): auto is the CPU
    ("cpu", ["0", "1"], 2, 1, ("cpu", [None, None])),
    ("auto", ["0", "1", "2", "3"], 2, 2, ("cuda", ["0,1", "2,3"])),
    ("cuda", ["5", "7"], 2, 1, ("cuda", ["5", "7"])),  # the ids this process sees, not 0, 1
    ("cuda", ["0", "1", "2"], 1, 2, ("cuda", ["0,1"])),
])
def test_each_replica_gets_gpus_of_its_own(device, gpus, size, tp, expected):
    assert replica_devices(device, gpus, size, tp) == expected


@pytest.mark.parametrize("device, gpus, size, tp", [
    ("auto", ["0"], 2, 1),  # auto must not send the second replica to the CPU
    ("auto", ["0", "1", "2"], 2, 2),  # nor give the second replica one GPU of its two ranks
    ("cuda", [], 2, 1),
])
def test_too_few_gpus_are_refused_before_any_process_starts(device, gpus, size, tp):
    with pytest.raises(ValueError, match=rf"--data-parallel-size {size} x --tensor-parallel-size "
                                         rf"{tp} needs {size * tp} GPUs .* sees {len(gpus)}"):
        replica_devices(device, gpus, size, tp)
    with pytest.raises(ValueError, match="--tensor-parallel-size must be an integer >= 1"):
        replica_devices(device, gpus, size, 0)  # an empty slice for every replica


def test_one_named_gpu_is_refused_for_replicas():
    """cuda:1 means GPU 1 of the GPUs a process sees; a replica sees only its own slice."""
    with pytest.raises(ValueError, match="--device cuda:1 names one GPU.*--device cuda"):
        replica_devices("cuda:1", ["0", "1"], 2, 1)


class Unrebuildable:
    """Pickles, but cannot be unpickled: rebuilding it calls int("not a number")."""

    def __reduce__(self):
        return int, ("not a number",)


def test_a_call_the_replica_cannot_unpickle_fails_alone(reference_llm):
    """The replica answers that call with the error and goes on serving the next. Its client
    is an EngineClient as LLMEngine is: the same limits, has_request from the ids the replica
    reports, and abort_request of an id it does not hold refused as LLMEngine refuses it."""
    with DataParallelLLM(serve_args("--data-parallel-size", "1")) as llm:
        (replica,) = llm.replicas
        assert isinstance(replica, EngineClient)
        assert replica.limits == reference_llm.engine.limits
        with pytest.raises(TypeError, match="replica 0 could not unpickle a call .*ValueError"):
            replica.add_request("bad", Unrebuildable(), SamplingParams(max_tokens=4))
        assert replica.is_up and not replica.has_request("bad")
        replica.add_request("good", "The for statement",
                            SamplingParams(max_tokens=4, ignore_eos=True))
        assert replica.has_request("good")
        with pytest.raises(ValueError, match="'other'"):
            replica.abort_request("other")
        outputs = []
        while replica.has_unfinished_requests():  # bounded: 4 tokens
            outputs += replica.step()
        assert outputs[-1].request_id == "good" and outputs[-1].finished
        assert len(outputs[-1].outputs[0].token_ids) == 4
        assert not replica.has_request("good")  # finished: the engine let it go
        replica.add_request("dropped", "The for statement", SamplingParams(max_tokens=4))
        replica.abort_request("dropped")
        assert not replica.has_request("dropped") and not replica.has_unfinished_requests()
    assert not replica.process.is_alive()


def test_a_dead_replica_fails_only_its_own_requests(replicas, server):
    """Last in the module: it kills replica 1 of the module's server."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                           timeout=120)
    long = {"model": MODEL, "prompt": "Return a list of the", "max_tokens": 400,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as http:
        # Two long streams: the router gives one to each replica.
        with http.stream("POST", server.url + "/v1/completions", json=long) as first, \
                http.stream("POST", server.url + "/v1/completions", json=long) as second:
            lines = [first.iter_lines(), second.iter_lines()]
            for stream in lines:
                next(line for line in stream if line.startswith("data: {"))
            wait_for(lambda: all(s["running"] == 1
                                 for s in server.app.state.engine.stats["replicas"]),
                     "one long request on each replica")
            replicas.replicas[1].process.kill()
            events = [json.loads(line[6:]) for stream in lines for line in stream
                      if line.startswith("data: {")]
        errors = [e for e in events if "error" in e]
        assert len(errors) == 1 and "replica 1 is down" in errors[0]["error"]["message"]
    # Its gauges fall to 0 (the step that found it dead updates them), not frozen at 1 running.
    wait_for(lambda: metric(server, "num_requests_running")["1"] == 0,
             "replica 1's running gauge at 0")
    assert metric(server, "kv_cache_usage_perc")["1"] == 0
    health = httpx.get(server.url + "/health")
    assert health.status_code == 503 and "replica 1" in health.json()["error"]["message"]
    # The live replica takes every request from now on.
    for _ in range(3):
        out = client.completions.create(model=MODEL, prompt="This module provides",
                                        max_tokens=4, temperature=0)
        assert out.choices[0].text
    replicas.shutdown()  # again at the fixture's end: a no-op then
    assert not any(r.process.is_alive() for r in replicas.replicas)
