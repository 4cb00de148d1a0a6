"""Speculative decoding behind the server and on the command line: /metrics exposes vLLM's
``spec_decode_*`` names under ``pagedllm:`` and they move after a speculative request (whose
tokens are plain decoding's); ``generate`` and ``serve`` refuse a bad ``--speculative-config``
in one error line naming the field, before any weight loads (the model folder's weights are
garbage, and a good configuration reaches them)."""

import shutil

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.optimized import LLM, SamplingParams
from pagedllm.serving.api_server import ServerThread
from pagedllm.serving.default_model import default_model_dir

from .conftest import MODEL, app_for, wait_until_idle

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
SPEC_NAMES = ["spec_decode_num_drafts", "spec_decode_num_draft_tokens",
              "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos"]
# Prompts whose greedy continuations on the tiny model repeat earlier spans (measured: some
# n-gram proposals are accepted in each).
PROMPTS = ["Return the value. Return the value. Return", "Once upon a time"]


def scrape(url: str) -> tuple[set, dict]:
    """The families' names (prefix removed) and {(sample name, labels): value}."""
    r = httpx.get(url + "/metrics", timeout=30)
    assert r.status_code == 200
    names, samples = set(), {}
    for family in text_string_to_metric_families(r.text):
        names.add(family.name.removeprefix("pagedllm:"))
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k not in ("model_name", "engine")}
            samples[(s.name.removeprefix("pagedllm:"), tuple(sorted(labels.items())))] = s.value
    return names, samples


@pytest.fixture(scope="module")
def spec_server():
    llm = LLM(default_model_dir(), seed=0, speculative_config=NGRAM)
    with ServerThread(app_for(llm)) as running:
        yield running


def test_metrics_after_a_speculative_request(spec_server):
    names, before = scrape(spec_server.url)
    assert set(SPEC_NAMES) <= names
    body = {"model": MODEL, "prompt": PROMPTS, "max_tokens": 16, "temperature": 0}
    r = httpx.post(f"{spec_server.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    wait_until_idle(spec_server)
    _, after = scrape(spec_server.url)

    def moved(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    drafts = moved("spec_decode_num_drafts_total")
    proposed = moved("spec_decode_num_draft_tokens_total")
    accepted = moved("spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and proposed >= drafts and 0 < accepted <= proposed
    per_pos = sum(moved("spec_decode_num_accepted_tokens_per_pos_total", position=str(j))
                  for j in range(4) if ("spec_decode_num_accepted_tokens_per_pos_total",
                                        (("position", str(j)),)) in after)
    assert per_pos == accepted  # every accepted token at its position in the run
    # the text is plain decoding's
    plain = LLM(default_model_dir(), seed=0).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["text"] for c in choices] == [o.outputs[0].text for o in plain]


@pytest.fixture(scope="module")
def garbage_weights(checkpoints, tmp_path_factory):
    """A checkpoint folder whose config and tokenizer are fine and whose weights are not:
    loading them fails, so a refusal naming speculative_config came before any load."""
    folder = shutil.copytree(checkpoints["llama"], tmp_path_factory.mktemp("garbage") / "m")
    for weights in folder.glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    return folder


BAD = [
    ('{"method": "ngram",', "--speculative-config is not valid JSON"),
    ('{"method": "eagle", "num_speculative_tokens": 2}',
     "speculative_config.method 'eagle' is not supported"),
    ('{"method": "ngram", "num_speculative_tokens": 0}',
     "speculative_config.num_speculative_tokens must be in [1, 64], got 0"),
    ('{"method": "ngram", "num_speculative_tokens": -3}',
     "speculative_config.num_speculative_tokens must be in [1, 64], got -3"),
    ('{"method": "ngram", "num_speculative_tokens": 65}',
     "speculative_config.num_speculative_tokens must be in [1, 64], got 65"),
]


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("config, message", BAD, ids=["json", "method", "zero", "negative",
                                                       "too-many"])
def test_a_bad_speculative_config_is_refused_before_weights_load(capsys, garbage_weights,
                                                                  command, config, message):
    from pagedllm.serving.cli import main

    extra = ["--prompt", "x"] if command == "generate" else ["--device", "cpu"]
    argv = [command, "--model", str(garbage_weights), *extra, "--speculative-config", config]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1
    assert message in captured.err and "safetensors" not in captured.err
    assert captured.out == ""


def test_a_good_speculative_config_reaches_the_weights(capsys, garbage_weights):
    """The folder's weights do fail to load: the refusals above came first."""
    from pagedllm.serving.cli import main

    assert main(["generate", "--model", str(garbage_weights), "--prompt", "x",
                 "--speculative-config", NGRAM]) == 2
    assert "safetensors" in capsys.readouterr().err
