"""echo on /v1/completions: the prompt's text before the completion, and with logprobs the
prompt tokens' logprobs in OpenAI's legacy layout (first None), as lm-evaluation-harness's
local-completions reads them; max_tokens 0 scores a prompt without generating; token-id prompts
(a list, a list of lists); echo on chat, and max_tokens 0 without echo, refused by name."""

import json

import httpx
import openai
import pytest

from pagedllm.optimized import SamplingParams

from .conftest import MODEL

PROMPTS = [[40, 41, 42, 43, 44, 45, 46], [300, 12, 77, 5]]


def post(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json={"model": MODEL, **body}, timeout=60)


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
    whole = post(server, {"prompt": PROMPTS[1], "max_tokens": 1, "prompt_logprobs": -1})
    assert all(len(e) == reference_llm.engine.vocab_size for e in
               whole.json()["choices"][0]["prompt_logprobs"][1:])


@pytest.mark.parametrize("body, field", [
    ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": -2}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": 10**6}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": "2"}, "prompt_logprobs"),
])
def test_prompt_logprobs_refused_by_name(server, body, field):
    r = post(server, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
