"""A client no one here wrote: lm-evaluation-harness runs a multiple-choice (loglikelihood) task
and a generate_until task through its ``local-completions`` model against the server, and gets
the scores its own ``hf`` backend (transformers) gets on the same checkpoint.

Both tasks are local (tests/data/lm_eval: a task YAML and a few JSONL rows each); nothing is
downloaded. Loglikelihood requests are what lm-eval sends to any OpenAI-compatible server:
``{prompt: [[token ids], ...], max_tokens: 1, temperature: 0, logprobs: 1, echo: true}``, read
back from ``choices[i].logprobs.token_logprobs`` and ``top_logprobs`` over the continuation.
"""

from pathlib import Path

import pytest
import yaml

from pagedllm.optimized import LLM
from pagedllm.reference.model.registry import packaged_gguf, resolve_model
from pagedllm.serving.api_server import ServerThread
from pagedllm.serving.default_model import default_model_dir

from .conftest import MODEL, app_for

TASKS = Path(__file__).parent.parent / "data" / "lm_eval"
LL_TOL = 1e-4  # float32 logits, summed in another order than transformers'
SMOLLM2 = "smollm2-135m-instruct"


def task_configs() -> list[dict]:
    """The shipped YAMLs, their data files made absolute (datasets reads them locally)."""
    configs = []
    for name in ("pagedllm_tiny_mc", "pagedllm_tiny_gen"):
        config = yaml.safe_load((TASKS / f"{name}.yaml").read_text())
        files = config["dataset_kwargs"]["data_files"]
        config["dataset_kwargs"]["data_files"] = {k: str(TASKS / v) for k, v in files.items()}
        configs.append(config)
    return configs


def evaluate(model: str, model_args: dict, batch_size: int) -> dict:
    from lm_eval import simple_evaluate

    return simple_evaluate(model=model, model_args=model_args, tasks=task_configs(),
                           batch_size=batch_size, log_samples=True, bootstrap_iters=0,
                           random_seed=0, numpy_random_seed=0, torch_random_seed=0)


def by_doc(samples: list[dict]) -> dict:
    return {s["doc_id"]: s for s in samples}


@pytest.fixture(scope="module")
def offline():
    """No hub: datasets and huggingface_hub read only what is on the disk."""
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_DATASETS_OFFLINE", "1")
    mp.setenv("HF_HUB_OFFLINE", "1")
    yield
    mp.undo()


def check_equal_scores(server_url: str, model_name: str, model_dir: str) -> dict:
    """lm-eval's local-completions through the server against its hf backend on model_dir:
    the same scores, each choice's loglikelihood and is_greedy, the same generated texts.
    Returns the served results (per task)."""
    served = evaluate("local-completions", {
        "model": model_name, "base_url": server_url + "/v1/completions",
        "tokenizer_backend": "huggingface", "tokenizer": model_dir, "max_retries": 1,
        "max_length": 1024}, batch_size=4)  # a list of token-id lists per request
    hf = evaluate("hf", {"pretrained": model_dir, "dtype": "float32", "device": "cpu"},
                  batch_size=1)
    for task in ("pagedllm_tiny_mc", "pagedllm_tiny_gen"):
        assert served["results"][task] == pytest.approx(hf["results"][task]), task
    mc = by_doc(served["samples"]["pagedllm_tiny_mc"])
    for doc_id, want in by_doc(hf["samples"]["pagedllm_tiny_mc"]).items():
        # one [(loglikelihood, is_greedy)] per choice
        got = [r[0] for r in mc[doc_id]["resps"]]
        for (ll, greedy), (want_ll, want_greedy) in zip(got, [r[0] for r in want["resps"]],
                                                         strict=True):
            assert ll == pytest.approx(want_ll, abs=LL_TOL)
            assert greedy == want_greedy
    gen = by_doc(served["samples"]["pagedllm_tiny_gen"])
    texts = {d: s["filtered_resps"] for d, s in gen.items()}
    assert texts == {d: s["filtered_resps"]
                     for d, s in by_doc(hf["samples"]["pagedllm_tiny_gen"]).items()}
    assert any(t[0].strip() for t in texts.values())  # the model wrote something
    return served["results"]


def test_lm_eval_through_the_server_scores_as_transformers(server, offline):
    pytest.importorskip("lm_eval")
    check_equal_scores(server.url, MODEL, str(default_model_dir()))


def test_lm_eval_on_smollm2_scores_as_transformers(offline):
    """The real chat model (make real-model), float32, served by the optimized tier."""
    pytest.importorskip("lm_eval")
    if packaged_gguf(SMOLLM2, install=False) is None:
        pytest.skip("SmolLM2-135M-Instruct is not installed (make real-model)")
    folder = resolve_model(SMOLLM2)
    with ServerThread(app_for(LLM(folder, seed=0), SMOLLM2)) as running:
        results = check_equal_scores(running.url, SMOLLM2, str(folder))
    print({task: {k: v for k, v in r.items() if "stderr" not in k}
           for task, r in results.items()})
