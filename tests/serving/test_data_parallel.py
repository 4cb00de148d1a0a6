"""Two data-parallel replicas behind one server (``--data-parallel-size 2``): a burst is served
with nothing lost and each answer equal to the request run alone, the requests spread over both
replicas, a client that hangs up frees the blocks of the replica that held it, the metrics add
up per replica and in total, and a replica that dies fails only its own requests."""

import argparse
import asyncio
import json
import re

import httpx
import openai
import pytest

from pagedllm.reference.engine.sampling_params import SamplingParams
from pagedllm.serving.api_server import ServerThread, build_app
from pagedllm.serving.args import add_serve_arguments
from pagedllm.serving.data_parallel import DataParallelLLM

from .conftest import MODEL, wait_for
from .test_concurrency import request


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
    with ServerThread(build_app(replicas, MODEL)) as running:
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
    health = httpx.get(server.url + "/health")
    assert health.status_code == 503 and "replica 1" in health.json()["error"]["message"]
    # The live replica takes every request from now on.
    for _ in range(3):
        out = client.completions.create(model=MODEL, prompt="This module provides",
                                        max_tokens=4, temperature=0)
        assert out.choices[0].text
    replicas.shutdown()  # again at the fixture's end: a no-op then
    assert not any(r.process.is_alive() for r in replicas.replicas)
