"""benchmarks/sharing.py in quick mode: sharing savings measured on real engine runs order as the
paper's do, and prefix caching saves the prefill tokens the prompt structure predicts."""

import json

import pytest

from pagedllm.benchmarks import sharing as sharing_benchmark

TRACES = ("alpaca", "sharegpt")
WIDTHS = ("2", "4", "6")


@pytest.fixture(scope="module")
def sharing(tmp_path_factory):
    path = tmp_path_factory.mktemp("sharing") / "sharing.json"
    returned = sharing_benchmark.main(["--quick", "--json", str(path)])
    written = json.loads(path.read_text())
    assert written["savings"] == json.loads(json.dumps(returned["savings"]))
    return written


def ours(sharing, trace, mode, width):
    return sharing["savings"][trace][mode][width]["ours"]


@pytest.mark.parametrize("trace", TRACES)
def test_beam_search_saves_more_than_parallel_sampling(sharing, trace):
    for width in WIDTHS:
        assert ours(sharing, trace, "beam", width) > ours(sharing, trace, "parallel", width)


@pytest.mark.parametrize("trace", TRACES)
def test_parallel_sampling_savings_grow_with_n(sharing, trace):
    savings = [ours(sharing, trace, "parallel", n) for n in WIDTHS]
    assert savings == sorted(savings) and len(set(savings)) == len(savings) and savings[0] > 0


@pytest.mark.parametrize("trace", TRACES)
def test_savings_sit_between_what_the_block_tables_allow(sharing, trace):
    res = sharing["savings"][trace]
    for width in WIDTHS:
        par, beam = res["parallel"][width], res["beam"][width]
        # samples share the prompt's full blocks, and the partly filled one only until a write
        assert par["prompt_blocks_only"] <= par["ours"] < par["prompt_blocks_only"] + 1
        # beams share at least the prompt and at most everything but their own last block
        assert beam["prompt_blocks_only"] <= beam["ours"] <= beam["all_but_last_block"]
        assert par["steps"] > 0 and beam["steps"] > 0
    engine = res["engine"]
    assert engine["preemptions"] == 0 and engine["cow_copies"] > 0
    assert engine["blocks_used_after"] == 0 and engine["tables_after"] == 0  # nothing leaked


def test_paper_values_sit_beside_ours(sharing):
    assert sharing["paper"]["savings"]["alpaca"]["parallel"] == {"2": 6.09, "4": 8.53, "6": 9.79}
    assert sharing["paper"]["savings"]["alpaca"]["beam"] == {"2": 37.56, "4": 53.13, "6": 55.16}
    assert sharing["paper"]["ranges"]["sharegpt"] == {"parallel": [16.2, 30.5],
                                                      "beam": [44.3, 66.3]}
    assert sharing["savings"]["alpaca"]["beam"]["6"]["paper"] == 55.16
    assert sharing["notes"]


def test_prefix_caching_saves_the_predicted_prefill_with_identical_tokens(sharing):
    rows = sharing["prefix_caching"]
    assert len(rows) >= 2
    for system_len, r in rows.items():
        assert r["prefill_tokens_on"] < r["prefill_tokens_off"] == r["prompt_tokens"], system_len
        assert r["measured_saved_share"] == pytest.approx(r["predicted_saved_share"], abs=1.0)
        assert r["tokens_identical"] and r["burst_tokens_identical"], system_len
        assert r["seconds_on"] > 0 and r["seconds_off"] > 0
    saved = [r["measured_saved_share"] for r in rows.values()]
    assert saved == sorted(saved)  # a longer system prompt is a larger share of each prompt
