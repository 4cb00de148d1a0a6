"""Bad requests get 400 / 413 / 404 with an OpenAI-style error body naming the field, and the
server answers a good request right after each; without the API key, 401."""

import threading

import httpx
import openai
import pytest

from pagedllm.reference.engine.llm import LLM
from pagedllm.reference.model.random_checkpoint import tiny_config, write_random_checkpoint
from pagedllm.serving.api_server import ServerThread

from .conftest import MODEL, app_for, wait_for, wait_until_idle

GOOD = {"model": MODEL, "prompt": "The for statement", "max_tokens": 3}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}

BAD = [  # (path, body, status, the field the error names)
    ("completions", {**GOOD, "max_tokens": "3"}, 400, "max_tokens"),
    ("completions", {**GOOD, "temperature": "hot"}, 400, "temperature"),
    ("completions", {**GOOD, "stream": "yes"}, 400, "stream"),
    ("completions", {**GOOD, "prompt": 42}, 400, "prompt"),
    ("completions", {"model": MODEL}, 400, "prompt"),
    ("completions", {**GOOD, "prompt": [7] * 1100}, 400, "prompt"),  # max_model_len is 1024
    ("completions", {**GOOD, "prompt": [1, 2, 99999]}, 400, "prompt"),  # outside the vocabulary
    ("completions", {**GOOD, "prompt": ""}, 400, "prompt"),
    ("completions", {**GOOD, "top_p": 2.0}, 400, "top_p"),
    ("completions", {**GOOD, "temperature": -1}, 400, "temperature"),
    ("completions", {**GOOD, "n": 0}, 400, "n"),
    ("completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {**GOOD, "top_k": -5}, 400, "top_k"),
    ("completions", {**GOOD, "seed": -1}, 400, "seed"),
    ("completions", {**GOOD, "stop": [""]}, 400, "stop"),
    ("completions", {**GOOD, "logprobs": 100000}, 400, "logprobs"),
    ("completions", {**GOOD, "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("completions", {**GOOD, "frequency_penalty": -2.1}, 400, "frequency_penalty"),
    ("completions", {**GOOD, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("completions", {**GOOD, "min_p": 1.5}, 400, "min_p"),
    ("completions", {**GOOD, "logit_bias": {"5": 100.5}}, 400, "logit_bias"),
    ("completions", {**GOOD, "logit_bias": {"99999": 1}}, 400, "logit_bias"),  # vocabulary
    ("completions", {**GOOD, "logit_bias": {"five": 1}}, 400, "logit_bias"),
    ("chat/completions", {**CHAT, "presence_penalty": -3}, 400, "presence_penalty"),
    ("chat/completions", {**CHAT, "logit_bias": {"-1": 1}}, 400, "logit_bias"),
    ("completions", {**GOOD, "model": "gpt-4"}, 404, "model"),
    ("chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": 3}]}, 400,
     "messages[0].content"),
    ("chat/completions", {**CHAT, "messages": [{"content": "Hi"}]}, 400, "messages[0].role"),
    ("chat/completions", {**CHAT, "max_tokens": 1.5}, 400, "max_tokens"),
    ("chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    # the engine's "prompt" is the request's own field for it
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": "word " * 1100}]},
     400, "messages"),
]


def assert_good_request_works(url: str):
    r = httpx.post(url + "/v1/completions", json=GOOD, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"]


@pytest.mark.parametrize("path, body, status, field", BAD,
                         ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_request_names_the_field(server, path, body, status, field):
    r = httpx.post(f"{server.url}/v1/{path}", json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == field, error
    assert error["message"] and error["type"] and error["code"] == status
    assert_good_request_works(server.url)


def test_a_refusal_without_a_field_names_none(server, monkeypatch):
    """The field comes from the engine's typed errors, never from the message's words: a
    plain ValueError is still a 400, naming no field."""
    def refuse(*args):
        raise ValueError("prompt of 5 tokens: n = 2 could never finish")

    monkeypatch.setattr(server.app.state.engine.client, "add_request", refuse)
    r = httpx.post(server.url + "/v1/completions", json=GOOD, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] is None, r.text
    monkeypatch.undo()
    assert_good_request_works(server.url)


def test_malformed_json_and_not_an_object(server):
    for raw in (b'{"prompt": "x",', b"[1, 2]", b"\xff\xfe"):
        r = httpx.post(server.url + "/v1/completions", content=raw, timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400, raw
        assert "JSON" in r.json()["error"]["message"]
        assert_good_request_works(server.url)


def test_the_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model=MODEL, prompt="x", top_p=7)


def test_body_over_the_limit_is_413(server):
    big = {**GOOD, "prompt": "word " * 300_000}  # 1.5 MB over the 1 MiB default
    r = httpx.post(server.url + "/v1/completions", json=big, timeout=30)
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"x" * 50_000
        yield b'"}'

    r = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=30)
    assert r.status_code == 413
    assert_good_request_works(server.url)


@pytest.fixture(scope="module")
def no_template_llm(tmp_path_factory):
    """A model whose tokenizer has no chat template (the random test checkpoints')."""
    path = write_random_checkpoint(tmp_path_factory.mktemp("plain") / "llama",
                                   tiny_config("llama"), seed=0, init_std=0.2)
    return LLM(path, kv_cache_memory=2**22)


def test_chat_without_a_template_and_the_api_key(no_template_llm):
    app = app_for(no_template_llm, "plain", api_key="sesame")
    with ServerThread(app) as server:
        assert server.host == "127.0.0.1"
        for path, body in (("completions", {"prompt": "hi", "max_tokens": 2}),
                           ("chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 2}),
                           ("models", None)):
            method = httpx.get if body is None else httpx.post
            kw = {} if body is None else {"json": body}
            r = method(f"{server.url}/v1/{path}", timeout=30, **kw)
            assert r.status_code == 401, path
            assert r.json()["error"]["type"] == "authentication_error"
            r = method(f"{server.url}/v1/{path}", timeout=30, **kw,
                       headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401
        assert httpx.get(server.url + "/health").status_code == 200  # no key needed
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="sesame", max_retries=0)
        assert client.completions.create(model="plain", prompt="hi", max_tokens=2).choices
        with pytest.raises(openai.BadRequestError, match="no chat template") as err:
            client.chat.completions.create(model="plain", max_tokens=2,
                                           messages=[{"role": "user", "content": "hi"}])
        assert err.value.body["param"] == "messages"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="nope",
                          max_retries=0).models.list()


def test_a_request_past_the_timeout_is_aborted(no_template_llm, monkeypatch):
    """A request that cannot finish inside --request-timeout gets a 408 (a last error event
    when streaming), is aborted, and leaves the engine holding nothing. It cannot finish by
    construction, not because this machine is slow: the engine's step waits until the server
    has answered and sent the abort, so at most one of its 100 tokens is made."""
    app = app_for(no_template_llm, "plain", request_timeout=0.02)
    engine, aborts = app.state.engine, app.state.metrics.finished["abort"]
    may_step, abort_sent = threading.Event(), threading.Event()
    real_step, real_abort = engine.client.step, engine.abort

    def gated_step():
        may_step.wait()
        return real_step()

    def noted_abort(request_id):
        real_abort(request_id)
        abort_sent.set()

    monkeypatch.setattr(engine.client, "step", gated_step)
    monkeypatch.setattr(engine, "abort", noted_abort)
    body = {"prompt": "hi", "max_tokens": 100, "ignore_eos": True}
    try:
        with ServerThread(app) as server:
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 408 and "time limit" in r.json()["error"]["message"]
            wait_for(abort_sent.is_set, "the abort after the 408")
            may_step.set()  # one step, then the abort at its boundary
            wait_for(lambda: aborts._value.get() == 1, "the engine taking the abort")
            # The engine holds no request, so it takes no step until the next one arrives.
            may_step.clear()
            abort_sent.clear()
            with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                              json={**body, "stream": True}) as r:
                assert r.status_code == 200
                events = [line for line in r.iter_lines() if line]
            assert "time limit" in events[-2] and events[-1] == "data: [DONE]"
            wait_for(abort_sent.is_set, "the abort after the stream's error event")
            may_step.set()
            wait_for(lambda: aborts._value.get() == 2, "the engine taking the second abort")
            assert wait_until_idle(server)["blocks_used"] == 0
            assert not no_template_llm.engine.has_unfinished_requests()
    finally:
        may_step.set()  # never leave the engine thread waiting, whatever failed
