"""benchmarks/step_profile.py in quick mode, on both tiers: every step is counted once, the
parts of the step time add up to it, and the steady window and torch.profiler's view are there.
Shares are printed, not asserted: they are timings."""

import pytest

from pagedllm.benchmarks import step_profile


@pytest.fixture(scope="module", params=["reference", "optimized"])
def profile(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "profile.json"
    return step_profile.main(["--quick", "--tier", request.param, "--json", str(path)])


def test_the_parts_add_up_to_the_steps(profile):
    p = profile["profile"]
    kinds = p["steps_by_kind"]
    assert kinds["prefill"]["steps"] > 0 and kinds["decode, full batch"]["steps"] > 0
    rows = p["run_breakdown_seconds"]
    assert all(seconds >= 0 for seconds in rows.values()), rows
    assert sum(rows.values()) == pytest.approx(p["run_seconds_in_steps"], rel=1e-6)


def test_the_steady_window_decodes_a_full_batch(profile):
    p, config = profile["profile"], profile["config"]
    layers = config["model"]["num_hidden_layers"]
    calls = p["steady_calls_per_step"]
    assert calls["paged_attention"] == calls["store_kv"] == layers and calls["sample"] == 1
    assert sum(p["steady_breakdown_ms_per_step"].values()) == pytest.approx(
        p["steady_ms_per_step"], rel=1e-6)
    groups = p["torch_profiler_groups"]
    assert groups["matrix_product_calls"] > 0 and groups["ms_per_step"]["attention"] > 0
