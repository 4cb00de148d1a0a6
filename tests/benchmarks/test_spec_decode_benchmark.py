"""benchmarks/spec_decode.py runs on the tiny model and reports every row: the engine plain, with
n-gram proposals and with a draft (the target's first layers), and transformers' plain,
prompt-lookup and assisted generation on the same prompt, each speculative way giving its
plain decoding's tokens (a short run: one workload, one sequence, 24 tokens; the numbers
themselves are the script's to print)."""

import math

from pagedllm.benchmarks.spec_decode import main
from pagedllm.serving.default_model import default_model_dir


def test_the_benchmark_reports_every_way(tmp_path):
    rows = main(["--model", str(default_model_dir()), "--quick", "--workloads", "edit",
                 "--draft-layers", "2", "--json", str(tmp_path / "spec.json")])
    ways = {(r["system"], r["way"]) for r in rows}
    assert ways == {("pagedllm", "plain"), ("pagedllm", "ngram"), ("pagedllm", "draft"),
                    ("transformers", "plain"), ("transformers", "prompt-lookup"),
                    ("transformers", "assisted")}
    for row in rows:
        assert row["same"], row  # speculation never changes a token
        assert row["tokens"] > 0 and math.isfinite(row["tok_per_s"]) and row["ratio"] > 0
        if row["system"] == "pagedllm" and row["way"] != "plain":
            assert 0 < row["steps_per_token"] <= 1 and 0 <= row["acceptance_rate"] <= 1
    assert (tmp_path / "spec.json").is_file()
