"""benchmarks/cpu_kernels.py on the tiny model: every way measured on every row count (bf16
activations; float32 ones on each of our paths this machine has), and the bytes they read
(ours the same bytes as torch's, reordered)."""

import json

import pytest

from pagedllm.benchmarks import cpu_kernels as bench
from pagedllm.kernels.cpu_ops import ISAS, cpu_extension, cpu_kernels


@pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernels did not build")
def test_every_way_is_measured_on_every_row_count(tmp_path):
    path = tmp_path / "cpu_kernels.json"
    report = bench.main(["--rows", "1,3", "--repeats", "1", "--calls", "1",
                         "--json", str(path)])
    assert json.loads(path.read_text()) == json.loads(json.dumps(report))
    machine = cpu_extension().machine_isa()
    paths = [isa for isa in ("avx512", "avx2") if ISAS.index(isa) >= ISAS.index(machine)]
    ways = ["int8, torch", "int8, ours", "int4 g32, torch", "int4 g32, ours", "bf16, F.linear",
            "bf16, ours", "fp32, F.linear", "int8 fp32, torch", "int4 g32 fp32, torch",
            "fp8, ours", "fp8 fp32, twin"] + [
        f"{kind} fp32, ours {isa}" for isa in paths for kind in ("int8", "int4 g32", "fp8")]
    assert sorted(report["rows"]) == [1, 3] and report["machine_isa"] == machine
    for row in report["rows"].values():
        assert sorted(row) == sorted(ways) and all(r["ms"] > 0 for r in row.values())
        assert row["bf16, F.linear"]["vs_f_linear"] == row["fp32, F.linear"]["vs_f_linear"] == 1
    sizes = report["weight_bytes"]
    assert sizes["bf16, ours"] == sizes["bf16, F.linear"]  # the same bytes, reordered
    assert sizes["int4 g32, ours"] == sizes["int4 g32, torch"]  # codes, scales, zero points
    # the same codes; ours keeps float32 scales and each output's code sum: 6 bytes an output
    assert 0 < sizes["int8, ours"] - sizes["int8, torch"] < sizes["int8, torch"] / 50
    # half a byte a weight plus 4 bytes a group of 32, against 2 bytes (and the bf16 head)
    assert sizes["int4 g32, ours"] < sizes["bf16, F.linear"] / 3
    # float32: a byte a weight (int8), 3/4 of one (int4: float32 scales, zeros) against four
    for isa in paths:
        assert sizes[f"int8 fp32, ours {isa}"] < sizes["fp32, F.linear"] / 3.8
        assert sizes[f"int4 g32 fp32, ours {isa}"] < sizes["fp32, F.linear"] / 5
        # fp8: the twin's codes and scales, reordered
        assert sizes[f"fp8 fp32, ours {isa}"] == sizes["fp8 fp32, twin"]
        assert sizes["fp8 fp32, twin"] < sizes["fp32, F.linear"] / 3.8
