"""The official `openai` client against the server: completions, streaming, chat, n = 2."""

import httpx

from pagedllm.reference.engine.sampling_params import SamplingParams

from .conftest import MODEL

PROMPT = "The for statement is used to"


def test_completion_matches_llm_generate(client, reference_llm):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    [choice] = out.choices
    alone = reference_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12),
                                   use_tqdm=False)[0]
    assert choice.text == alone.outputs[0].text and choice.text
    assert choice.finish_reason == {"length": "length"}.get(alone.outputs[0].finish_reason,
                                                              "stop")
    assert out.object == "text_completion" and out.model == MODEL
    assert out.usage.prompt_tokens == len(alone.prompt_token_ids)
    assert out.usage.completion_tokens == len(alone.outputs[0].token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_streamed_deltas_equal_the_whole_text(client):
    """Same seed, same text, streamed or not; also with a stop string, which the server must
    not have half-sent when the engine cuts it out of the text."""
    for stop in (None, ["the", ".\n"]):
        kw = dict(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0.9, seed=11, stop=stop)
        whole = client.completions.create(**kw).choices[0]
        chunks = list(client.completions.create(stream=True, **kw))
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
        assert streamed == whole.text, stop
        assert chunks[-1].choices[0].finish_reason == whole.finish_reason
        assert len(chunks) > 3  # it did stream, a step at a time


def test_stream_ends_with_done_and_usage(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    assert '"completion_tokens": 5' in events[-2]  # the usage chunk comes last


def test_chat_completion(client, reference_llm):
    messages = [{"role": "user", "content": "What does the for statement do?"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                         temperature=0)
    alone = reference_llm.chat(messages, SamplingParams(temperature=0, max_tokens=16),
                               use_tqdm=False)[0]
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == alone.outputs[0].text
    assert out.usage.prompt_tokens == len(alone.prompt_token_ids)
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                              temperature=0, stream=True)
    chunks = list(streamed)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == alone.outputs[0].text


def test_n_2(client, reference_llm):
    kw = dict(temperature=1.0, seed=5, max_tokens=10)
    out = client.completions.create(model=MODEL, prompt=PROMPT, n=2, **kw)
    assert [c.index for c in out.choices] == [0, 1]
    alone = reference_llm.generate([PROMPT], SamplingParams(n=2, **kw), use_tqdm=False)[0]
    assert [c.text for c in out.choices] == [c.text for c in alone.outputs]
    assert out.choices[0].text != out.choices[1].text  # two samples, two streams of draws
    assert out.usage.completion_tokens == sum(len(c.token_ids) for c in alone.outputs)


def test_logprobs_and_top_k(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                    logprobs=3, extra_body={"top_k": 5, "ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(top) == 3 for top in lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs)
    assert "".join(lp.tokens) == out.choices[0].text
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
        temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)


def test_models_and_health(client, server):
    [model] = client.models.list().data
    assert model.id == MODEL
    assert httpx.get(server.url + "/health").status_code == 200
