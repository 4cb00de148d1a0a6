"""The tokenizer endpoints in vLLM's shapes (POST /tokenize, POST /detokenize, GET
/tokenizer_info), and the sampling controls (penalties, min_p, logit_bias) on both OpenAI
endpoints, through the official client and plain HTTP."""

import httpx
import openai
import pytest

from .conftest import MODEL


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_tokenize_and_detokenize_round_trip(server, served_llm):
    r = post(server, "/tokenize", {"model": MODEL, "prompt": "Hello world"})
    assert r.status_code == 200, r.text
    body = r.json()
    want = served_llm.tokenizer("Hello world")["input_ids"]
    assert body["tokens"] == want and body["count"] == len(want)
    assert body["max_model_len"] == server.app.state.engine.limits.max_model_len
    assert body["token_strs"] is None
    r = post(server, "/detokenize", {"model": MODEL, "tokens": body["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": "Hello world"}, r.text


def test_tokenize_a_conversation_uses_the_chat_template(server, client, served_llm):
    messages = [{"role": "user", "content": "Hi there"}]
    r = post(server, "/tokenize", {"messages": messages, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["token_strs"]) == body["count"] == len(body["tokens"])
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert chat.usage.prompt_tokens == body["count"]  # the prompt the server would run
    template = served_llm.tokenizer.apply_chat_template(messages, tokenize=False,
                                                        add_generation_prompt=True)
    assert body["tokens"] == served_llm.tokenizer(template, add_special_tokens=False)[
        "input_ids"]


def test_tokenizer_info_has_what_lm_eval_reads(server, served_llm):
    r = httpx.get(server.url + "/tokenizer_info", timeout=60)
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["eos_token"] == served_llm.tokenizer.eos_token
    assert info["chat_template"] == served_llm.tokenizer.chat_template
    assert isinstance(info["tokenizer_class"], str)


@pytest.mark.parametrize("path, body, field", [
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"model": "gpt-4", "prompt": "x"}, "model"),
    ("/detokenize", {"tokens": [1, 99999]}, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, "tokens[0]"),
    ("/detokenize", {}, "tokens"),
])
def test_bad_tokenizer_requests_name_the_field(server, path, body, field):
    r = post(server, path, body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == field, r.text


def test_the_controls_change_the_tokens_on_both_endpoints(client):
    base = dict(model=MODEL, prompt="The cache", max_tokens=12, temperature=0.0)
    plain = client.completions.create(**base).choices[0].text
    ids = client.completions.create(**base, logprobs=0).choices[0].logprobs.tokens
    assert plain
    first = post_tokenize_one(client, ids[0])
    banned = client.completions.create(**base, logit_bias={str(first): -100}).choices[0].text
    assert banned != plain
    penalised = client.completions.create(**base, frequency_penalty=2.0, presence_penalty=2.0,
                                          extra_body={"repetition_penalty": 2.0}).choices[0]
    assert penalised.text != plain
    greedy_like = client.completions.create(**{**base, "temperature": 1.0}, seed=3,
                                            extra_body={"min_p": 1.0}).choices[0].text
    assert greedy_like == plain
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                temperature=0.0)
    got = client.chat.completions.create(**chat, presence_penalty=1.5, frequency_penalty=1.0,
                                         logit_bias={str(first): 100},
                                         extra_body={"min_p": 0.2})
    assert got.choices[0].message.content == ids[0] * 6  # the biased token, every time


def post_tokenize_one(client, text: str) -> int:
    """The first token id of a token's text, through /tokenize (no special tokens)."""
    base = str(client.base_url).removesuffix("/v1/").removesuffix("/v1")
    r = httpx.post(base + "/tokenize", json={"prompt": text, "add_special_tokens": False},
                   timeout=60)
    return r.json()["tokens"][0]


def test_out_of_range_controls_are_a_400_naming_the_field(client):
    base = dict(model=MODEL, prompt="x", max_tokens=2)
    for extra, field in [({"presence_penalty": 2.5}, "presence_penalty"),
                         ({"frequency_penalty": -3}, "frequency_penalty"),
                         ({"logit_bias": {"3": 200}}, "logit_bias"),
                         ({"extra_body": {"repetition_penalty": -1}}, "repetition_penalty"),
                         ({"extra_body": {"min_p": 2}}, "min_p")]:
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(**base, **extra)
        assert err.value.body["param"] == field
