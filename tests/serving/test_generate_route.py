"""POST /generate, vLLM's demo server's route (``python -m vllm.entrypoints.api_server``), beside
the OpenAI routes: its body ({"prompt", "stream", ...SamplingParams' fields}) and its answer
({"text": [prompt + completion, ...]}); a stream sends that object after every step, one JSON
line each, the last one the whole answer. Requests are logged (id, prompt length, sampling
parameters) when the app logs requests, as ``pagedllm serve`` does unless
--disable-log-requests."""

import json
import logging

import httpx
import pytest

from pagedllm.serving.api_server import ServerThread

from .conftest import app_for

PROMPT = "The for statement is used to"


@pytest.fixture(scope="module")
def url(served_llm):
    with ServerThread(app_for(served_llm, log_requests=True)) as running:
        yield running.url


def post(url, **body):
    return httpx.post(url + "/generate", json=body, timeout=120)


def test_the_answer_is_the_prompt_and_its_completion(url, reference_llm):
    from pagedllm.reference import SamplingParams
    answer = post(url, prompt=PROMPT, max_tokens=6, temperature=0, ignore_eos=True)
    assert answer.status_code == 200, answer.text
    (out,) = reference_llm.generate([PROMPT], SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    assert answer.json() == {"text": [PROMPT + out.outputs[0].text]}


def test_n_samples_answer_one_text_each(url):
    texts = post(url, prompt=PROMPT, n=2, max_tokens=4, seed=1).json()["text"]
    assert len(texts) == 2 and all(t.startswith(PROMPT) for t in texts)


def test_a_stream_sends_the_text_so_far_after_every_step(url):
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", url + "/generate", json={**body, "stream": True},
                      timeout=120) as answer:
        assert answer.status_code == 200
        raw = b"".join(answer.iter_bytes())
    lines = raw.decode().splitlines()
    assert raw.endswith(b"\n") and len(lines) >= 2
    texts = [json.loads(line)["text"][0] for line in lines]
    assert all(later.startswith(earlier) for earlier, later in
               zip(texts, texts[1:], strict=False))
    assert texts[-1] == post(url, **body).json()["text"][0]


@pytest.mark.parametrize("body,field", [
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": PROMPT, "stream": "yes"}, "stream"),
    ({"prompt": PROMPT, "max_token": 3}, "max_token"),
    ({"prompt": PROMPT, "temperature": -1}, "temperature"),
])
def test_a_bad_body_is_a_400_naming_the_field(url, body, field):
    answer = post(url, **body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == field


def test_each_request_is_logged_with_its_id_prompt_length_and_params(url, caplog,
                                                                      served_llm):
    length = len(served_llm.tokenizer(PROMPT)["input_ids"])
    with caplog.at_level(logging.INFO, logger="pagedllm.serving"):
        post(url, prompt=PROMPT, max_tokens=2, temperature=0)
    (record,) = [r for r in caplog.records if r.getMessage().startswith("Received request")]
    message = record.getMessage()
    assert "generate-" in message and f"prompt length {length} tokens" in message
    assert "max_tokens=2" in message and "temperature=0" in message
