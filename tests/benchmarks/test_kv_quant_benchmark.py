"""benchmarks/kv_quant.py --quick on the tiny model: every row measured, the capacities the
formats promise, and the failure case it constructs showing the failure."""

import json

import pytest

from pagedllm.benchmarks import kv_quant


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    path = tmp_path_factory.mktemp("kv_quant") / "kv_quant.json"
    returned = kv_quant.main(["--quick", "--json", str(path)])
    assert json.loads(path.read_text()) == json.loads(json.dumps(returned))
    return returned["results"][0]


def test_every_dtype_is_measured(report):
    rows = report["rows"]
    assert list(rows) == [label for label, _, _ in kv_quant.VARIANTS]
    assert rows["auto"]["max_abs_logit_diff"] == 0 and rows["auto"]["top1_agreement"] == 1
    for row in rows.values():
        assert row["perplexity"] > 1 and 0 <= row["top1_agreement"] <= 1
    # int8 is the closest of the 8-bit formats (a scale per token and head, 255 levels)
    assert rows["int8"]["max_abs_logit_diff"] < rows["fp8_e4m3"]["max_abs_logit_diff"]
    assert rows["int4"]["max_abs_logit_diff"] > rows["int8"]["max_abs_logit_diff"]


def test_capacities_are_the_formats_bytes(report):
    rows = report["rows"]  # the tiny model: head_dim 32
    assert rows["fp8_e4m3"]["capacity_vs_bf16"] == pytest.approx(2.0, rel=1e-3)
    assert rows["int8"]["capacity_vs_bf16"] == pytest.approx(64 / 34, rel=1e-3)
    assert rows["int4"]["capacity_vs_bf16"] == pytest.approx(64 / 20, rel=1e-3)
    assert rows["int8"]["capacity_vs_fp32"] == pytest.approx(128 / 34, rel=1e-3)


def test_out_of_range_keys_hurt_scale_one_not_calculated_scales(report):
    o = report["outlier_keys"]
    assert o["key_absmax_before"] < 448 < o["key_absmax_after"]
    assert o["fp8_e4m3"]["max_abs_logit_diff"] > 2 * o["fp8_e4m3 calculated"]["max_abs_logit_diff"]
    assert o["auto"]["perplexity"] == pytest.approx(report["rows"]["auto"]["perplexity"],
                                                    rel=1e-4)  # the same model, rescaled
