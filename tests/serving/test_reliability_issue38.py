"""Issue 38, through the HTTP server on both tiers: each was a frozen server, a wrong answer or a
500 before its fix.

- a JSON schema nested deeper than the stated limit is a 400 naming the field, checked before
  xgrammar sees it; an allowed grammar is built off the event loop, so /health and the other
  clients are answered while it is built;
- a constraint nothing satisfies is a 400 naming its field (at the door where its start allows
  nothing, else when the output reaches a dead end), never "stop" for text the grammar refused;
- a stream's text_offset with stop strings is the whole answer's;
- every logit_bias key or value that is not a token id and a number in range is a 400 naming it;
- a lone surrogate anywhere in a body gives an error body that is valid JSON.
"""

import json
import threading

import httpx
import pytest

from pagedllm import reference
from pagedllm.reference.engine.structured_outputs import StructuredOutputsParams
from pagedllm.reference.engine.structured_outputs import params as so_params
from pagedllm.reference.engine.validation import FieldValueError
from pagedllm.serving.default_model import default_model_dir
from pagedllm.serving.server_thread import ServerThread

from .conftest import MODEL, app_for, wait_for, wait_until_idle

GOOD = {"model": MODEL, "prompt": "The for statement", "max_tokens": 3}
CHAT = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module", params=["optimized", "reference"])
def server(request, served_llm):
    llm = served_llm if request.param == "optimized" else reference.LLM(default_model_dir(),
                                                                        seed=0)
    with ServerThread(app_for(llm)) as running:
        yield running


def post(server, body, path="completions", timeout=60):
    return httpx.post(f"{server.url}/v1/{path}", json=body, timeout=timeout)


def post_raw(server, raw: bytes, path="v1/completions"):
    return httpx.post(f"{server.url}/{path}", content=raw, timeout=60,
                      headers={"content-type": "application/json"})


def stream_events(server, body, path="completions") -> list[dict]:
    """The decoded data events of a streamed answer ([DONE] left out)."""
    events = []
    with httpx.stream("POST", f"{server.url}/v1/{path}", json={**body, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def assert_serving(server):
    r = post(server, GOOD)
    assert r.status_code == 200, r.text
    assert wait_until_idle(server)["blocks_used"] == 0


def nested_arrays(levels: int) -> dict:
    schema = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


def json_depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max((json_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((json_depth(v) for v in value), default=0)
    return 0


# -- 1. a deep schema: refused by a stated limit; an allowed one is built off the loop -----------
LIMIT = so_params.MAX_SCHEMA_DEPTH


def schema_fields(schema) -> list:
    """(path, extra body, the param the 400 names) for each way a request gives a schema."""
    return [
        ("completions", {"guided_json": schema}, "guided_json"),
        ("completions", {"guided_json": json.dumps(schema)}, "guided_json"),
        ("completions", {"structured_outputs": {"json": schema}}, "structured_outputs"),
        ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
            "name": "deep", "schema": schema}}}, "response_format.json_schema.schema"),
    ]


@pytest.mark.parametrize("path, extra, param", schema_fields(nested_arrays(LIMIT + 40)))
def test_a_schema_nested_past_the_limit_is_a_400_naming_the_field(server, path, extra, param):
    base = GOOD if path == "completions" else {"model": MODEL, "messages": CHAT,
                                              "max_tokens": 3}
    r = post(server, {**base, **extra}, path)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and f"at most {LIMIT}" in error["message"], error
    assert error["message"].startswith(param), error  # the client's name for the field
    assert_serving(server)


def test_the_issues_800_levels_are_refused_and_the_limit_itself_is_accepted(server):
    r = post(server, {**GOOD, "guided_json": nested_arrays(800)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_json", r.text
    at_limit = nested_arrays(LIMIT - 1)  # the string leaf is one object more
    assert json_depth(at_limit) == LIMIT
    r = post(server, {**GOOD, "max_tokens": 4, "guided_json": at_limit})
    assert r.status_code == 200, r.text
    r = post(server, {**GOOD, "guided_json": nested_arrays(LIMIT)})
    assert r.status_code == 400 and f"at most {LIMIT}" in r.json()["error"]["message"]


@pytest.mark.parametrize("raw, what", [
    (b'{"prompt": "x", "guided_json": "' + b"[" * 100_000 + b'"}', "JSON text nested 100000 deep"),
    (b'{"prompt": "x", "guided_json": "' + b'{\\"a\\": ' * 3000 + b"1" + b"}" * 3000 + b'"}',
     "JSON text of objects 3000 deep"),
], ids=["string-schema-of-arrays", "string-schema-of-objects"])
def test_a_schema_given_as_deep_json_text_is_a_400(server, raw, what):
    """guided_json as text is decoded by the server: nested past Python's recursion limit it
    raised RecursionError (a 500)."""
    r = post_raw(server, raw)
    assert r.status_code == 400, (what, r.text[:300])
    assert r.json()["error"]["param"] == "guided_json"
    assert_serving(server)


def ref_chain(n: int) -> dict:
    """$ref -> $ref -> ... n long: xgrammar's conversion grows faster than cubically with it
    (1000 took 0.4 s, 10000 took 9 minutes) although the schema is two levels deep."""
    defs = {f"a{i}": {"$ref": f"#/$defs/a{i + 1}"} for i in range(n)}
    defs[f"a{n}"] = {"type": "string", "maxLength": 3}
    return {"$defs": defs, "$ref": "#/$defs/a0"}


def test_a_schema_with_more_refs_than_the_limit_is_a_400(server):
    limit = so_params.MAX_SCHEMA_REFS
    r = post(server, {**GOOD, "structured_outputs": {"json": ref_chain(limit + 1)}})
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"] == "structured_outputs"
    assert f"at most {limit}" in r.json()["error"]["message"]
    r = post(server, {**GOOD, "max_tokens": 6, "structured_outputs": {"json": ref_chain(8)}})
    assert r.status_code == 200, r.text


def test_health_and_other_requests_answer_while_a_grammar_is_built(server, monkeypatch):
    """The grammar of a request is held in its build (an Event) until the test lets it go; the
    server must answer /health and a plain completion meanwhile. Ordering, not time: before the
    fix the build ran on the event loop, so neither answer could come until it was let go (or
    its guard ran out, which the test reports)."""
    marker = {"type": "string", "description": "held-in-its-build", "maxLength": 4}
    entered, release = threading.Event(), threading.Event()
    gave_up = threading.Event()
    original = StructuredOutputsParams.to_grammar

    def held(self):
        if "held-in-its-build" in self.source and not entered.is_set():
            entered.set()
            if not release.wait(30):  # a guard: only an unfixed server waits this long
                gave_up.set()
        return original(self)

    monkeypatch.setattr(StructuredOutputsParams, "to_grammar", held)
    answers = {}

    def slow_request():
        answers["slow"] = post(server, {**GOOD, "guided_json": marker})

    thread = threading.Thread(target=slow_request)
    thread.start()
    try:
        wait_for(entered.is_set, "the grammar's build starting")
        health = httpx.get(f"{server.url}/health", timeout=60)
        still_held_at_health = not release.is_set() and not gave_up.is_set()
        plain = post(server, GOOD)
        still_held_at_plain = not release.is_set() and not gave_up.is_set()
    finally:
        release.set()
        thread.join(120)
    assert health.status_code == 200 and still_held_at_health, "/health waited for the build"
    assert plain.status_code == 200 and still_held_at_plain, "a completion waited for it"
    assert answers["slow"].status_code == 200, answers["slow"].text
    assert len(answers["slow"].json()["choices"][0]["text"]) <= 6  # '"' + 4 + '"'
    assert_serving(server)


def test_the_grammar_is_converted_once(server, monkeypatch):
    """The Grammar built at the door (off the loop) is the one the compile thread compiles: the
    schema is not converted again."""
    xgr = so_params.load_xgrammar()
    calls, original = [], xgr.Grammar.from_json_schema

    def counted(schema, *args, **kwargs):
        calls.append(schema)
        return original(schema, *args, **kwargs)

    monkeypatch.setattr(xgr.Grammar, "from_json_schema", staticmethod(counted))
    schema = {"type": "string", "description": "converted-once", "maxLength": 3}
    r = post(server, {**GOOD, "guided_json": schema})
    assert r.status_code == 200, r.text
    assert len([s for s in calls if "converted-once" in s]) == 1


# -- 2. a constraint nothing satisfies: a 400 naming the field, never "stop" -------------------
@pytest.mark.parametrize("path, extra, param", [
    ("completions", {"guided_regex": r"[^\s\S]"}, "guided_regex"),
    ("completions", {"structured_outputs": {"grammar": 'root ::= root "a"'}},
     "structured_outputs"),
    ("chat/completions", {"guided_grammar": 'root ::= x\nx ::= x "b" | root'},
     "guided_grammar"),
    ("chat/completions", {"structured_outputs": {"regex": "[^\\s\\S]+"}},
     "structured_outputs"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_constraint_whose_start_allows_nothing_is_refused_at_the_door(server, path, extra,
                                                                        param, stream):
    base = GOOD if path == "completions" else {"model": MODEL, "messages": CHAT,
                                              "max_tokens": 3}
    r = post(server, {**base, **extra, "stream": stream}, path)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "nothing can satisfy" in error["message"], error
    assert_serving(server)


DEAD_END = {"type": "string", "pattern": r"[^\s\S]"}  # '"' is allowed, then nothing


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_a_constraint_that_reaches_a_dead_end_is_a_400_not_stop(server, path):
    """The start allows '"', then no token can follow: the engine ends the request with
    finish_reason "error", which was answered as a 200 with text '"' and "stop"."""
    base = GOOD if path == "completions" else {"model": MODEL, "messages": CHAT,
                                              "max_tokens": 3}
    r = post(server, {**base, "max_tokens": 8, "guided_json": DEAD_END}, path)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "guided_json" and "cannot be satisfied" in error["message"], error
    assert_serving(server)


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_a_streamed_dead_end_ends_with_an_error_event_not_stop(server, path):
    base = GOOD if path == "completions" else {"model": MODEL, "messages": CHAT}
    events = stream_events(server, {**base, "max_tokens": 8, "n": 2,
                                    "structured_outputs": {"json": DEAD_END}}, path)
    reasons = [c.get("finish_reason") for e in events for c in e.get("choices", [])]
    assert "stop" not in reasons, events
    assert events[-1]["error"]["param"] == "structured_outputs", events
    assert "cannot be satisfied" in events[-1]["error"]["message"]
    assert_serving(server)


def test_a_grammar_whose_compile_fails_is_a_400_not_an_empty_stop(server):
    """A compile that fails on the engine's compile thread (here injected; for real: no token
    of this vocabulary may start the output) ends the request with finish_reason "error":
    it was a 200 with text "" and "stop"."""
    warm = post(server, {**GOOD, "guided_choice": ["warm"]})  # the compiler exists
    assert warm.status_code == 200, warm.text
    compiler = server.app.state.engine.client.grammars.compiler

    def broken(spec):
        raise FieldValueError("structured_outputs", "injected compile failure")

    compiler._compile, original = broken, compiler._compile
    try:
        r = post(server, {**GOOD, "guided_regex": "[0-9]{6}"})
        events = stream_events(server, {**GOOD, "guided_regex": "[0-9]{7}"})
    finally:
        compiler._compile = original
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "guided_regex"
    assert "cannot be satisfied" in r.json()["error"]["message"]
    assert events[-1]["error"]["param"] == "guided_regex", events
    assert_serving(server)


# -- 4. streamed text_offset with stop strings ------------------------------------------------
@pytest.mark.parametrize("stop", [["a stop string that never comes up", "zzz"],
                                  ["the next cycle", "a stop string that never comes up"]],
                         ids=["no-stop-met", "a-stop-met"])
@pytest.mark.parametrize("echo", [False, True])
def test_streamed_text_offsets_with_stop_strings_match_the_whole_answer(server, echo, stop):
    """The stream holds back len(longest stop) - 1 characters; its offsets counted the
    characters sent, so they lagged by the held-back text. (The greedy text has "the next
    cycle" after 18 tokens.)"""
    body = {**GOOD, "prompt": "The with statement", "max_tokens": 24, "temperature": 0.0,
            "ignore_eos": True, "logprobs": 1, "echo": echo, "stop": stop}
    whole = post(server, body)
    assert whole.status_code == 200, whole.text
    expected = whole.json()["choices"][0]["logprobs"]
    offsets, tokens = [], []
    for event in stream_events(server, body):
        for choice in event["choices"]:
            if choice["logprobs"] is not None:
                offsets += choice["logprobs"]["text_offset"]
                tokens += choice["logprobs"]["tokens"]
    assert tokens == expected["tokens"]
    assert offsets == expected["text_offset"]


# -- 7. logit_bias: keys that are not token ids, values out of range ---------------------------
@pytest.mark.parametrize("raw", [
    '{"²": 1}', '{"①": 1}', '{"٣": 1}', '{"' + "9" * 5000 + '": 1}', '{"-1": 1}',
    '{"4096": 1}', '{"99999999999999999999999": 1}', '{"": 1}', '{" ": 1}',
    '{"1.0": 1}', '{"0x1": 1}', '{"+1": 1}', '{"1e3": 1}', '{"1": "x"}', '{"1": null}',
    '{"1": true}', '{"1": NaN}', '{"1": Infinity}', '{"1": -Infinity}', '{"1": 1e400}',
    '{"1": 101}', '{"1": -100.5}', '{"1": [1]}', '[[1, 1]]', '"1"', '{"1": 1e-400, "x": 1}',
], ids=lambda raw: raw[:24])
def test_logit_bias_extremes_are_400s_naming_it(server, raw):
    body = b'{"prompt": "x", "max_tokens": 2, "logit_bias": ' + raw.encode() + b"}"
    r = post_raw(server, body)
    assert r.status_code == 400, (raw[:40], r.text[:300])
    assert r.json()["error"]["param"].startswith("logit_bias"), r.text[:300]
    assert_serving(server)


def test_logit_bias_at_its_limits_is_accepted(server):
    r = post(server, {**GOOD, "logit_bias": {"0": -100, " 5 ": 100, "4095": 0.5, "007": 1e-300}})
    assert r.status_code == 200, r.text


# -- 8. lone surrogates: every error body is valid JSON ----------------------------------------
SURROGATE_BODIES = [
    ("v1/completions", b'{"model": "\\ud800", "prompt": "x", "max_tokens": 2}'),
    ("v1/completions", b'{"prompt": "x", "structured_outputs": {"\\ud800": 1}}'),
    ("v1/completions", b'{"prompt": "x", "max_tokens": 2, "stop": ["\\ud800"]}'),
    ("v1/completions", b'{"prompt": "x", "max_tokens": 2, "stop": "a\\udfff"}'),
    ("v1/completions", b'{"prompt": "x\\ud800", "max_tokens": 2}'),
    ("v1/completions", b'{"prompt": ["ok", "\\udc00"], "max_tokens": 2}'),
    ("v1/completions", b'{"prompt": "x", "max_tokens": 2, "logit_bias": {"\\ud800": 1}}'),
    ("v1/completions", b'{"prompt": "x", "max_tokens": 2, "guided_regex": "\\ud800"}'),
    ("v1/completions", b'{"prompt": "x", "max_tokens": 2, "guided_choice": ["\\ud800"]}'),
    ("v1/completions", b'{"prompt": "x", "max_tokens": 2, "guided_grammar": '
                       b'"root ::= \\"\\ud800\\""}'),
    ("v1/completions", b'{"prompt": "x", "max_tokens": 2, "guided_json": '
                       b'{"type": "string", "pattern": "\\ud800"}}'),
    ("v1/completions", b'{"prompt": "x", "max_tokens": 2, "guided_json": "{\\"\\ud800\\": 1}"}'),
    ("v1/completions", b'{"prompt": "x", "max_tokens": 2, "response_format": '
                       b'{"type": "\\ud800"}}'),
    ("v1/completions", b'{"prompt": "x", "max_tokens": 2, "user": "\\ud800"}'),
    ("v1/completions", b'{"prompt": "x", "max_tokens": "\\ud800"}'),
    ("v1/completions", b'{"\\ud800": 1, "prompt": "x", "max_tokens": 2}'),
    ("v1/chat/completions", b'{"model": "\\udbff", "messages": [{"role": "user", '
                            b'"content": "hi"}]}'),
    ("v1/chat/completions", b'{"messages": [{"role": "\\ud800", "content": "hi"}], '
                            b'"max_tokens": 2}'),
    ("v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("tokenize", b'{"model": "\\ud800", "prompt": "x"}'),
    ("tokenize", b'{"prompt": "\\ud800"}'),
    ("detokenize", b'{"model": "\\ud800", "tokens": [1]}'),
]


@pytest.mark.parametrize("path, raw", SURROGATE_BODIES,
                         ids=[f"{p}:{raw[:40].decode()}" for p, raw in SURROGATE_BODIES])
def test_lone_surrogates_get_answers_that_are_valid_json(server, path, raw):
    r = post_raw(server, raw, path)
    assert r.status_code < 500, r.text[:300]
    body = json.loads(r.content.decode("utf-8"))  # strict UTF-8: no surrogate escapes
    json.dumps(body, ensure_ascii=False).encode("utf-8")  # no lone surrogate decoded either
    if r.status_code != 200:
        assert set(body["error"]) >= {"message", "type", "param", "code"}, body
    assert_serving(server)
