"""benchmarks/weight_quant.py --quick on the tiny model: every scheme measured or skipped with
its reason, the baseline agreeing with itself, and the bytes each scheme promises."""

import json

import pytest

from pagedllm.benchmarks import weight_quant


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    path = tmp_path_factory.mktemp("weight_quant") / "weight_quant.json"
    returned = weight_quant.main(["--quick", "--json", str(path)])
    assert json.loads(path.read_text()) == json.loads(json.dumps(returned))
    return returned["results"][0]


def test_every_scheme_is_measured_or_skipped_with_its_reason(report):
    labels = [label for label, *_ in weight_quant.SCHEMES]
    assert sorted([*report["schemes"], *report["skipped"]]) == sorted(labels)
    # The tiny model's down_proj has 704 inputs: groups of 128 cannot cover it, and it says so.
    assert "down_proj (in 704)" in report["skipped"]["int4 g128"]
    assert "not a .gguf model" in report["skipped"]["gguf"]  # the tiny model is a folder
    base = report["schemes"]["bfloat16"]
    assert base["top1_agreement"] == 1 and base["ppl_change_pct"] == 0
    for row in report["schemes"].values():
        assert row["perplexity"] > 1


def test_fewer_bits_fewer_bytes(report):
    rows = report["schemes"]
    assert rows["float32"]["weight_bytes"] == 2 * rows["bfloat16"]["weight_bytes"]
    assert rows["int4 g64"]["weight_bytes"] < rows["int4 g32"]["weight_bytes"] \
        < rows["int8"]["weight_bytes"] < rows["bfloat16"]["weight_bytes"]
    # GPTQ moves codes on the same grid: its checkpoints hold their scheme's bytes exactly
    assert rows["fp8 GPTQ"]["weight_bytes"] == rows["fp8"]["weight_bytes"]
    assert rows["int8 GPTQ"]["weight_bytes"] == rows["int8"]["weight_bytes"]
