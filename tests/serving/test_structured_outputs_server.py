"""Structured outputs through the server: OpenAI's response_format (json_object, json_schema) on
both endpoints, vLLM's structured_outputs extra body field (json, regex, choice, grammar) and
its older guided_* fields, through the official client and plain HTTP. Every finished output
follows its spec; a malformed spec is a 400 naming the request's field with xgrammar's reason,
and leaves the engine serving other requests with no block held."""

import json
import re

import httpx
import jsonschema
import pytest

from pagedllm.reference.engine.sampling_params import SamplingParams
from pagedllm.reference.engine.structured_outputs import StructuredOutputsParams

from .conftest import MODEL, wait_until_idle

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
CHAT = [{"role": "user", "content": "Describe a person as JSON."}]


def post(server, body, path="completions"):
    return httpx.post(f"{server.url}/v1/{path}", json=body, timeout=60)


def test_json_schema_on_chat_through_the_client(client):
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=60, temperature=1.0, seed=4, n=3,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON}})
    for choice in chat.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_schema_and_json_object_on_completions(client):
    out = client.completions.create(
        model=MODEL, prompt="The with statement", max_tokens=60, seed=1,
        extra_body={"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "p", "schema": PERSON}}})
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].text), PERSON)
    out = client.completions.create(model=MODEL, prompt="def main", max_tokens=40, seed=2,
                                    temperature=1.0, n=4,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert any(c.finish_reason == "stop" for c in out.choices)
    for c in out.choices:
        assert c.text.startswith("{")
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)


@pytest.mark.parametrize("field, value, check", [
    ("structured_outputs", {"choice": ["red", "green", "blue"]},
     lambda t: t in ("red", "green", "blue")),
    ("structured_outputs", {"regex": r"[0-9]{3}-[0-9]{4}"},
     lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
    ("structured_outputs", {"grammar": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),
    ("structured_outputs", {"json": PERSON}, lambda t: jsonschema.validate(json.loads(t),
                                                                            PERSON) is None),
    ("guided_choice", ["up", "down"], lambda t: t in ("up", "down")),
    ("guided_regex", "[a-c]{4}", lambda t: re.fullmatch("[a-c]{4}", t)),
    ("guided_json", json.dumps(PERSON), lambda t: jsonschema.validate(json.loads(t),
                                                                       PERSON) is None),
    ("guided_grammar", 'root ::= "a" ("b" | "bb" | "bbb")', lambda t: re.fullmatch("ab{1,3}", t)),
])
def test_vllms_extra_body_fields(client, field, value, check):
    for path in ("completions", "chat"):
        if path == "completions":
            out = client.completions.create(model=MODEL, prompt="A list is", max_tokens=40,
                                            temperature=1.0, seed=3, n=2,
                                            extra_body={field: value})
            texts = [(c.text, c.finish_reason) for c in out.choices]
        else:
            out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40,
                                                 temperature=1.0, seed=3, n=2,
                                                 extra_body={field: value})
            texts = [(c.message.content, c.finish_reason) for c in out.choices]
        for text, reason in texts:
            assert reason == "stop" and check(text), text


def test_the_server_answers_as_the_engine_does(server, reference_llm):
    """The same seeded request through the server and through LLM.generate: the same text."""
    body = {"model": MODEL, "prompt": "The with statement", "max_tokens": 40, "seed": 9,
            "temperature": 1.0, "structured_outputs": {"json": PERSON}}
    r = post(server, body)
    assert r.status_code == 200, r.text
    params = SamplingParams(max_tokens=40, seed=9, temperature=1.0,
                            structured_outputs=StructuredOutputsParams(json=PERSON))
    alone = reference_llm.generate(["The with statement"], params, use_tqdm=False)
    assert r.json()["choices"][0]["text"] == alone[0].outputs[0].text


def test_a_stream_follows_the_grammar(client):
    stream = client.completions.create(model=MODEL, prompt="A list is", max_tokens=40,
                                       seed=5, stream=True,
                                       extra_body={"structured_outputs": {"json": PERSON}})
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), PERSON)


def test_a_schema_that_cannot_finish_ends_with_length(server):
    """The text is the part of the document written so far: a valid prefix, not JSON."""
    schema = {"type": "object", "properties": {"text": {"type": "string", "minLength": 500}},
              "required": ["text"]}
    r = post(server, {"model": MODEL, "prompt": "x", "max_tokens": 10,
                      "structured_outputs": {"json": schema}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["text"].startswith('{"text": "')
    assert r.json()["usage"]["completion_tokens"] == 10


@pytest.mark.parametrize("path, extra, param, reason", [
    ("completions", {"structured_outputs": {"json": {"type": "objekt"}}}, "structured_outputs",
     'Unsupported type "objekt"'),
    ("completions", {"structured_outputs": {"regex": "(ab"}}, "structured_outputs",
     "parenthesis is not closed"),
    ("completions", {"structured_outputs": {"grammar": "root ::= nothing"}},
     "structured_outputs", 'Rule "nothing" is not defined'),
    ("completions", {"structured_outputs": {"choice": []}}, "structured_outputs",
     "non-empty list"),
    ("completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}},
     "structured_outputs", "exactly one of"),
    ("completions", {"structured_outputs": {"json": PERSON, "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern", "not supported"),
    ("completions", {"guided_json": '{"type": "objekt"}'}, "guided_json",
     'guided_json is not a valid JSON schema: Unsupported type "objekt"'),
    ("completions", {"guided_regex": "[z-a]"}, "guided_regex", "guided_regex"),
    ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
     "response_format.json_schema.schema", "response_format.json_schema.schema is not a valid"),
    ("chat/completions", {"response_format": {"type": "json_schema"}},
     "response_format.json_schema", "is required"),
    ("chat/completions", {"response_format": {"type": "json_schema",
                                              "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "is required"),
    ("completions", {"response_format": {"type": "json_object"},
                     "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "both ask for a structured output"),
    ("completions", {"response_format": "json"}, "response_format", "dict"),
])
def test_malformed_specs_are_400s_naming_the_field(server, path, extra, param, reason):
    base = ({"model": MODEL, "prompt": "x", "max_tokens": 4} if path == "completions" else
            {"model": MODEL, "messages": CHAT, "max_tokens": 4})
    r = post(server, {**base, **extra}, path)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and reason in error["message"], error
    assert wait_until_idle(server)["blocks_used"] == 0
    ok = post(server, {"model": MODEL, "prompt": "The for statement", "max_tokens": 3})
    assert ok.status_code == 200 and server.app.state.engine.is_running


def test_a_bad_spec_does_not_disturb_a_request_in_flight(server, reference_llm):
    """A long request streams while malformed specs arrive and are refused: its text is the
    one it has alone."""
    body = {"model": MODEL, "prompt": "The with statement", "max_tokens": 48, "seed": 2,
            "temperature": 1.0, "ignore_eos": True, "stream": True}
    chunks = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        for i, line in enumerate(r.iter_lines()):
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:])["choices"][0]["text"])
            if i in (2, 4, 6):
                bad = post(server, {"model": MODEL, "prompt": "x",
                                    "structured_outputs": {"regex": "(("}})
                assert bad.status_code == 400
    params = SamplingParams(max_tokens=48, seed=2, temperature=1.0, ignore_eos=True)
    alone = reference_llm.generate(["The with statement"], params, use_tqdm=False)
    assert "".join(chunks) == alone[0].outputs[0].text
    assert wait_until_idle(server)["blocks_used"] == 0
