"""benchmarks/kv_kinds.py, a short run: every kind of KV cache generates its requests, the peak
the pool held (counted from stats() at every step) is what the planner predicts, a window or a
latent holds less than every layer keeping every token, and nothing is left in the pool."""

from pagedllm.benchmarks.kv_kinds import main


def test_each_kind_holds_what_the_planner_says(tmp_path):
    rows = {r["kind"]: r for r in main(["--quick", "--json", str(tmp_path / "kv.json")])}
    assert set(rows) == {"full", "windowed", "hybrid", "latent"}
    for r in rows.values():
        assert r["tokens"] == 2 * 40 and r["blocks_left"] == 0
        assert r["peak_bytes"] == r["planner_bytes"]
    assert rows["full"]["peak_bytes"] == rows["full"]["every_layer_bytes"]
    for kind in ("windowed", "hybrid", "latent"):
        assert rows[kind]["peak_bytes"] < rows[kind]["every_layer_bytes"]
    assert rows["hybrid"]["kv_cache_groups"] == 6  # 5 windowed layers and 1 full, a group each
    assert (tmp_path / "kv.json").is_file()
