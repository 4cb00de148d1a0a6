"""Inputs and faults found by an adversarial review: each was a 500, a wrong answer, a hang or a
dead engine thread before its fix. The rule they check: an accepted request always finishes,
everything else is refused at the door with a 400 naming the field, and no error leaves the
engine thread dead or a block held."""

import asyncio
import json

import httpx
import pytest

from pagedllm.reference.engine.sampling_params import SamplingParams
from pagedllm.serving.async_engine import AsyncLLMEngine, EngineStepError

from .conftest import HANG_GUARD_S, MODEL, wait_for, wait_until_idle

GOOD = {"model": MODEL, "prompt": "The for statement", "max_tokens": 3}


def post(server, body, path="completions", **kw):
    return httpx.post(f"{server.url}/v1/{path}", json=body, timeout=60, **kw)


def post_raw(server, raw: bytes, path="completions"):
    return httpx.post(f"{server.url}/v1/{path}", content=raw, timeout=60,
                      headers={"content-type": "application/json"})


def assert_serving(server):
    r = post(server, GOOD)
    assert r.status_code == 200, r.text
    assert server.app.state.engine.is_running


# -- JSON the parser itself refuses with something other than JSONDecodeError: was a 500 -------
@pytest.mark.parametrize("raw", [
    b"[" * 50_000 + b"]" * 50_000,  # RecursionError
    b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",  # over Python's 4300 digits
], ids=["nested-50000-deep", "int-of-5000-digits"])
def test_json_the_parser_chokes_on_is_400(server, raw):
    r = post_raw(server, raw)
    assert r.status_code == 400, r.text
    assert "JSON" in r.json()["error"]["message"]
    assert_serving(server)


# -- sampling values that passed SamplingParams but broke the sampler --------------------------
def test_top_k_past_int64_does_not_fail_the_step(server):
    """top_k = 2**63 passed the checks, then overflowed int64 inside a step: a 500, and every
    other request in that step ended with an error too. At or above the vocabulary it means
    all tokens, as top_k = -1 does."""
    errors = server.app.state.metrics.finished["error"]
    errors_before = errors._value.get()
    body = {**GOOD, "max_tokens": 6, "seed": 3, "ignore_eos": True}
    r = post(server, {**body, "top_k": 2**63})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == post(server, {**body, "top_k": -1}).json()[
        "choices"][0]["text"]
    assert errors._value.get() == errors_before


def test_a_tiny_top_p_keeps_the_most_likely_token(server):
    """top_p = 1e-300 is in (0, 1] but rounds to 0 as float32: every token was cut and the
    sampler drew token 0. It must keep the most likely token, as any top_p below it does."""
    body = {**GOOD, "max_tokens": 5, "seed": 1, "ignore_eos": True}
    greedy = post(server, {**body, "temperature": 0}).json()["choices"][0]
    for top_p in (1e-300, 1e-10):
        got = post(server, {**body, "top_p": top_p}).json()["choices"][0]
        assert got["text"] == greedy["text"], top_p


def test_a_temperature_past_float32_is_refused(server):
    """temperature 1e39 became inf in the sampler, a blocked token's -inf logit / inf = NaN,
    and min_tokens' blocked end-of-sequence token came out first."""
    r = post(server, {**GOOD, "temperature": 1e39, "min_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "temperature"
    assert_serving(server)


# -- text no tokenizer can encode ---------------------------------------------------------------
def test_a_lone_surrogate_names_its_field(server):
    r = post_raw(server, b'{"prompt": "ab\\ud800", "max_tokens": 2}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    r = post_raw(server, b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
                 "chat/completions")
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages[0].content"
    assert_serving(server)


# -- OpenAI fields the engine cannot honour (or not at that value) were ignored silently --
@pytest.mark.parametrize("path, extra, field", [
    ("completions", {"logit_bias": {"50": 101}}, "logit_bias"),  # outside [-100, 100]
    ("chat/completions", {"logit_bias": {"50": -1000}}, "logit_bias"),
    # structured outputs are served (test_structured_outputs_server.py); not as YAML
    ("chat/completions", {"response_format": {"type": "yaml"}}, "response_format"),
    ("chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("completions", {"bad_words": ["the"]}, "bad_words"),  # vLLM's, not implemented here
    ("chat/completions", {"allowed_token_ids": [5, 6]}, "allowed_token_ids"),
])
def test_unsupported_openai_fields_are_refused(server, path, extra, field):
    base = GOOD if path == "completions" else {
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    r = post(server, {**base, **extra}, path)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    # their defaults, as clients send them, are accepted
    ok = {"logit_bias": {}, "response_format": {"type": "text"}, "tools": [], "bad_words": [],
          "allowed_token_ids": None}[field]
    assert post(server, {**base, field: ok}, path).status_code == 200


def test_text_parts_are_joined_as_vllm_joins_them(server):
    def prompt_tokens(content):
        body = {"model": MODEL, "max_tokens": 1,
                "messages": [{"role": "user", "content": content}]}
        r = post(server, body, "chat/completions")
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    assert prompt_tokens(parts) == prompt_tokens("first\nsecond")


# -- faults in the engine thread outside engine.step(): the thread died, requests hung ----------
def test_a_failing_stats_read_neither_kills_the_thread_nor_hangs(server, monkeypatch):
    engine = server.app.state.engine
    real = engine.client.stats
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] in (2, 3, 4):
            raise RuntimeError("injected: stats failed")
        return real()

    monkeypatch.setattr(engine.client, "stats", flaky)
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={**GOOD, "max_tokens": 8, "ignore_eos": True, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines)
    assert calls["n"] > 4 and engine.is_running
    monkeypatch.undo()
    assert_serving(server)
    assert wait_until_idle(server)["blocks_used"] == 0


def test_a_failing_abort_neither_kills_the_thread_nor_leaks(server, monkeypatch):
    engine = server.app.state.engine
    real = engine.client.abort_request
    calls = {"n": 0}

    def flaky(request_id):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected: abort failed")
        return real(request_id)

    monkeypatch.setattr(engine.client, "abort_request", flaky)
    # Long enough that the server sees the hang-up before the request could end by itself
    # (200 tokens once ended first on an idle machine, and no abort ever came).
    body = {**GOOD, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 2:
                break  # hang up: the abort fails
    wait_for(lambda: calls["n"] >= 1, "the hang-up turning into an abort")
    r = post(server, GOOD)  # the thread is alive and serving
    assert r.status_code == 200, r.text
    assert engine.is_running
    # the request whose abort failed runs to its end in the engine, which frees it then
    assert wait_until_idle(server)["blocks_used"] == 0


def test_shutdown_ends_live_requests_and_refuses_new_ones(reference_llm):
    """shutdown() aborted the live requests without a word to their streams (a reader waited
    forever), and an add racing the thread's end was never answered."""

    async def scenario():
        engine = AsyncLLMEngine(reference_llm.engine)
        engine.start()
        params = SamplingParams(max_tokens=500, ignore_eos=True)
        stream = await engine.add_request("long", "The for statement", params)
        await stream.__anext__()  # it runs
        await asyncio.to_thread(engine.shutdown)
        with pytest.raises(EngineStepError):
            async with asyncio.timeout(HANG_GUARD_S):
                async for _ in stream:
                    pass
        engine._thread = type("Alive", (), {"is_alive": lambda self: True})()  # the race
        with pytest.raises(RuntimeError, match="not running"):
            async with asyncio.timeout(HANG_GUARD_S):
                await engine.add_request("late", "x", SamplingParams(max_tokens=2))
        return reference_llm.engine.stats()

    stats = asyncio.run(scenario())
    assert stats["blocks_used"] == 0 and not reference_llm.engine.has_unfinished_requests()


def test_streams_of_every_shape_end_with_done(server):
    """n > 1, several prompts, a stop string longer than the output, logprobs: every stream
    ends with [DONE] and its choices' texts equal the same request without streaming."""
    body = {"model": MODEL, "prompt": ["The for statement", "😀 ünïcödé 中文"], "n": 2,
            "max_tokens": 12, "seed": 7, "logprobs": 2, "stop": ["x" * 500, "\n"]}
    full = post(server, body).json()
    texts: dict[int, str] = {}
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                      timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        for choice in json.loads(line.removeprefix("data: "))["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {c["index"]: c["text"] for c in full["choices"]}
    assert wait_until_idle(server)["blocks_used"] == 0
