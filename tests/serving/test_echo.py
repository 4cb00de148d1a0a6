"""echo on /v1/completions: the prompt's text before the completion, and with logprobs the
prompt tokens' logprobs in OpenAI's legacy layout (first None), as lm-evaluation-harness's
local-completions reads them; max_tokens 0 scores a prompt without generating; token-id prompts
(a list, a list of lists); echo on chat, and max_tokens 0 without echo, refused by name. More
logprobs than the engine's max_logprobs (20, vLLM's default) are refused by name, prompt_logprobs
-1 (the whole vocabulary) among them; a server started with --max-logprobs -1 serves them."""

import json

import httpx
import openai
import pytest

from pagedllm.optimized import SamplingParams
from pagedllm.serving.api_server import ServerThread, load_llm
from pagedllm.serving.cli import build_parser

from .conftest import MODEL, app_for

PROMPTS = [[40, 41, 42, 43, 44, 45, 46], [300, 12, 77, 5]]


CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def post(server, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=60)


@pytest.fixture(scope="module")
def uncapped_server():
    """`pagedllm serve --max-logprobs -1`: the flags, through load_llm, to the engine."""
    llm = load_llm(build_parser().parse_args(["serve", "--max-logprobs", "-1", "--device", "cpu",
                                              "--tier", "optimized"]))
    assert llm.engine.limits.max_logprobs == -1
    with ServerThread(app_for(llm)) as running:
        yield running


def engine_prompt_logprobs(llm, prompt, k):
    """The same prompt through LLM.generate: its prompt logprobs and greedy completion."""
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k),
                       use_tqdm=False)[0]
    return out.prompt_logprobs, out.outputs[0]


def test_echo_with_logprobs_over_token_id_prompts(server, reference_llm):
    r = post(server, {"prompt": PROMPTS, "max_tokens": 1, "temperature": 0, "logprobs": 1,
                      "echo": True, "seed": 1234})  # what lm-eval sends for loglikelihood
    assert r.status_code == 200, r.text
    body = r.json()
    tok = reference_llm.tokenizer
    for choice, prompt in zip(sorted(body["choices"], key=lambda c: c["index"]), PROMPTS,
                              strict=True):
        entries, completion = engine_prompt_logprobs(reference_llm, prompt, 1)
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(prompt) + 1
        assert lp["tokens"] == [tok.decode([t]) for t in prompt + completion.token_ids]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for i in range(1, len(prompt)):
            assert lp["token_logprobs"][i] == pytest.approx(entries[i][prompt[i]], abs=1e-5)
            assert len(lp["top_logprobs"][i]) == 1
            assert max(lp["top_logprobs"][i].values()) >= lp["token_logprobs"][i] - 1e-6
        assert choice["text"] == tok.decode(prompt) + completion.text
        assert lp["text_offset"][0] == 0
        assert lp["text_offset"] == sorted(lp["text_offset"])
    assert body["usage"]["completion_tokens"] == 2


def test_max_tokens_0_scores_the_prompt_alone(server, reference_llm):
    r = post(server, {"prompt": PROMPTS[0], "max_tokens": 0, "logprobs": 2, "echo": True})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert choice["text"] == reference_llm.tokenizer.decode(PROMPTS[0])
    assert choice["finish_reason"] == "length"
    entries, _ = engine_prompt_logprobs(reference_llm, PROMPTS[0], 2)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(PROMPTS[0])
    assert lp["token_logprobs"][1:] == pytest.approx(
        [entries[i][t] for i, t in enumerate(PROMPTS[0]) if i], abs=1e-5)
    assert body["usage"] == {"prompt_tokens": len(PROMPTS[0]), "completion_tokens": 0,
                             "total_tokens": len(PROMPTS[0])}


def test_echo_through_the_openai_client_and_in_a_stream(server, client):
    whole = client.completions.create(model=MODEL, prompt="The list", max_tokens=5,
                                      temperature=0, echo=True, logprobs=2)
    text = whole.choices[0].text
    assert text.startswith("The list") and len(text) > len("The list")
    lp = whole.choices[0].logprobs
    assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])
    plain = client.completions.create(model=MODEL, prompt="The list", max_tokens=5,
                                      temperature=0)
    assert text == "The list" + plain.choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt="The list", max_tokens=5,
                                            temperature=0, echo=True, logprobs=2,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs
               for o in c.choices[0].logprobs.text_offset]
    assert offsets == lp.text_offset
    no_logprobs = client.completions.create(model=MODEL, prompt="The list", max_tokens=5,
                                            temperature=0, echo=True)
    assert no_logprobs.choices[0].text == text and no_logprobs.choices[0].logprobs is None


def test_max_tokens_0_in_a_stream(server):
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"prompt": PROMPTS[1], "max_tokens": 0, "echo": True,
                            "logprobs": 0, "stream": True}) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert len(events) == 1
    choice = events[0]["choices"][0]
    assert choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(PROMPTS[1])


@pytest.mark.parametrize("path, body, field", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "echo": "yes"}, "echo"),
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": -1}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                              "echo": True}, "echo"),
])
def test_refused_by_name(server, client, path, body, field):
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    with pytest.raises(openai.BadRequestError):  # the client sees the same refusal
        client.post(path.removeprefix("/v1"), body=body, cast_to=object)


def test_vllms_prompt_logprobs_field(server, reference_llm):
    """vLLM's extra body field: on each completion choice, per prompt token None (the first)
    or {id: {logprob, rank, decoded_token}} for the token and the k most likely; on a chat
    answer, the same list beside the choices."""
    r = post(server, {"prompt": PROMPTS, "max_tokens": 2, "temperature": 0, "n": 2,
                      "prompt_logprobs": 3})
    assert r.status_code == 200, r.text
    tok = reference_llm.tokenizer
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert len(choices) == 4 and choices[0]["logprobs"] is None  # logprobs not asked for
    for i, choice in enumerate(choices):
        prompt = PROMPTS[i // 2]
        out = reference_llm.generate({"prompt_token_ids": prompt}, SamplingParams(
            temperature=0, max_tokens=1, prompt_logprobs=3), use_tqdm=False)[0]
        got = choice["prompt_logprobs"]
        assert got[0] is None and len(got) == len(prompt)
        for j in range(1, len(prompt)):
            entry = got[j]
            own = entry[str(prompt[j])]
            assert own["logprob"] == pytest.approx(out.prompt_logprobs[j][prompt[j]], abs=1e-5)
            assert own["rank"] == out.prompt_token_ranks[j]
            assert own["decoded_token"] == tok.decode([prompt[j]])
            top = sorted((v for k, v in entry.items() if k != str(prompt[j]) or v["rank"] <= 3),
                         key=lambda v: v["rank"])
            assert [v["rank"] for v in top] == [1, 2, 3]
            assert [v["logprob"] for v in top] == sorted((v["logprob"] for v in top),
                                                         reverse=True)
            assert len(entry) == 3 + (own["rank"] > 3)
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
        "prompt_logprobs": 0}).json()
    entries = chat["prompt_logprobs"]
    assert entries[0] is None and all(len(e) == 1 for e in entries[1:])
    assert len(entries) == chat["usage"]["prompt_tokens"]


@pytest.mark.parametrize("body, field", [
    ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": -2}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),  # above max_logprobs = 20
    ({"prompt": "x", "prompt_logprobs": 10**6}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": "2"}, "prompt_logprobs"),
])
def test_prompt_logprobs_refused_by_name(server, body, field):
    r = post(server, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


# -- max_logprobs: 20 unless the server is started with more -------------------------------------
CAPPED = [  # (path, body, the field named): each asks for 21, or the whole vocabulary
    ("/v1/completions", {"prompt": PROMPTS[0], "echo": True, "logprobs": 21, "max_tokens": 1},
     "logprobs"),
    ("/v1/completions", {"prompt": PROMPTS[0], "logprobs": 21, "max_tokens": 1}, "logprobs"),
    ("/v1/completions", {"prompt": PROMPTS[0], "prompt_logprobs": 21, "max_tokens": 1},
     "prompt_logprobs"),
    ("/v1/completions", {"prompt": PROMPTS[0], "prompt_logprobs": -1, "max_tokens": 1},
     "prompt_logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "prompt_logprobs": -1}, "prompt_logprobs"),
]


@pytest.mark.parametrize("path, body, field", CAPPED, ids=[f"{i}-{c[2]}"
                                                           for i, c in enumerate(CAPPED)])
def test_more_than_max_logprobs_is_refused_by_name(server, client, path, body, field):
    r = post(server, body, path)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field
    assert "max_logprobs = 20" in error["message"] and "--max-logprobs" in error["message"]
    with pytest.raises(openai.BadRequestError):  # the client sees the same refusal
        client.post(path.removeprefix("/v1"), body=body, cast_to=object)
    # the cap itself is served, and the refusal left the engine serving
    at_cap = {k: (20 if v in (21, -1) else v) for k, v in body.items()}
    r = post(server, at_cap, path)
    assert r.status_code == 200, r.text


def test_max_logprobs_minus_1_serves_the_whole_vocabulary(uncapped_server, reference_llm):
    vocab = reference_llm.engine.limits.vocab_size
    assert vocab > 21
    whole = post(uncapped_server, {"prompt": PROMPTS[1], "max_tokens": 1, "prompt_logprobs": -1})
    assert whole.status_code == 200, whole.text
    entries = whole.json()["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(PROMPTS[1])
    assert all(len(e) == vocab for e in entries[1:])
    echo = post(uncapped_server, {"prompt": PROMPTS[0], "max_tokens": 1, "temperature": 0,
                                  "echo": True, "logprobs": 21})
    assert echo.status_code == 200, echo.text
    top = echo.json()["choices"][0]["logprobs"]["top_logprobs"]
    assert top[0] is None and len(top) == len(PROMPTS[0]) + 1
    assert all(len(t) == 21 for t in top[1:])
    chat = post(uncapped_server, {**CHAT, "logprobs": True, "top_logprobs": 21},
                "/v1/chat/completions")
    assert chat.status_code == 200, chat.text
    content = chat.json()["choices"][0]["logprobs"]["content"]
    assert content and all(len(t["top_logprobs"]) == 21 for t in content)
    chat = post(uncapped_server, {**CHAT, "prompt_logprobs": -1}, "/v1/chat/completions")
    assert chat.status_code == 200, chat.text
    assert all(len(e) == vocab for e in chat.json()["prompt_logprobs"][1:])
    past = post(uncapped_server, {"prompt": "x", "prompt_logprobs": vocab + 1})
    assert past.status_code == 400 and past.json()["error"]["param"] == "prompt_logprobs"
    assert "vocabulary" in past.json()["error"]["message"]
