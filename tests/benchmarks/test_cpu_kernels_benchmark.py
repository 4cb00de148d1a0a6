"""benchmarks/cpu_kernels.py on the tiny model: all six ways measured on every row count, and
the bytes they read (ours the same bytes as torch's, reordered)."""

import json

import pytest

from pagedllm.benchmarks import cpu_kernels as bench
from pagedllm.kernels.cpu_ops import cpu_kernels


@pytest.mark.skipif(cpu_kernels() is None, reason="no AVX-512 BF16, or no build")
def test_every_way_is_measured_on_every_row_count(tmp_path):
    path = tmp_path / "cpu_kernels.json"
    report = bench.main(["--rows", "1,3", "--repeats", "1", "--calls", "1",
                         "--json", str(path)])
    assert json.loads(path.read_text()) == json.loads(json.dumps(report))
    ways = ["int8, torch", "int8, ours", "int4 g32, torch", "int4 g32, ours", "bf16, F.linear",
            "bf16, ours"]
    assert sorted(report["rows"]) == [1, 3]
    for row in report["rows"].values():
        assert sorted(row) == sorted(ways) and all(r["ms"] > 0 for r in row.values())
    sizes = report["weight_bytes"]
    assert sizes["bf16, ours"] == sizes["bf16, F.linear"]  # the same bytes, reordered
    assert sizes["int4 g32, ours"] == sizes["int4 g32, torch"]  # codes, scales, zero points
    # the same codes; ours keeps float32 scales and each output's code sum: 6 bytes an output
    assert 0 < sizes["int8, ours"] - sizes["int8, torch"] < sizes["int8, torch"] / 50
    # half a byte a weight plus 4 bytes a group of 32, against 2 bytes (and the bf16 head)
    assert sizes["int4 g32, ours"] < sizes["bf16, F.linear"] / 3
