"""The deployment planner: weight bytes per scheme, weights and KV per GPU at a TP size, and
the questions of seeds 003 (400B on 8 x A100-80GB) and 004 (a 7B model at 16 bits)."""

import pytest

from pagedllm.reference.deployment import (
    WEIGHT_PRESETS,
    bytes_per_weight,
    deployment,
    describe_deployment,
)
from pagedllm.reference.kv_size import GIB, PRESETS, kv_size, main


def test_bytes_per_weight_counts_the_scales():
    assert bytes_per_weight(None, 2) == 2
    assert bytes_per_weight("fp8", 2) == 1
    assert bytes_per_weight("int8", 2, in_features=4096) == 1 + 2 / 4096
    assert bytes_per_weight("int4", 2, group_size=32) == 0.625  # 0.5 + (scale + zero) / 32
    assert bytes_per_weight("int4", 2, group_size=128) == 0.53125
    with pytest.raises(ValueError, match="nf4"):
        bytes_per_weight("nf4", 2)


def test_every_weight_preset_has_a_kv_shape():
    assert set(WEIGHT_PRESETS) <= set(PRESETS)


def test_seed_004_a_7b_model_at_16_bits():
    # Seed 004: about 14.6 GB of 16-bit weights for a 7B model (Mistral-7B: 7.24e9 parameters).
    d = deployment(kv_size("mistral-7b"), gpu_memory_gib=80)
    assert 14.4e9 < d.weight_bytes < 14.6e9
    int8 = deployment(kv_size("mistral-7b"), 80, quantization="int8")
    int4 = deployment(kv_size("mistral-7b"), 80, quantization="int4", group_size=32)
    # The 131M-parameter embedding stays 16-bit: int8 a bit over half, int4 about a third.
    assert 0.5 < int8.weight_bytes / d.weight_bytes < 0.52
    assert 0.31 < int4.weight_bytes / d.weight_bytes < 0.34
    # What the weights give up goes to the KV cache.
    assert int4.tokens > int8.tokens > d.tokens
    assert int8.kv_bytes_per_gpu - d.kv_bytes_per_gpu == pytest.approx(
        d.weight_bytes - int8.weight_bytes)


def test_seed_003_400b_on_eight_a100_80gb():
    kv = kv_size("llama-3.1-405b", "bfloat16")
    bf16 = deployment(kv, 80, tensor_parallel_size=8)
    assert bf16.weight_bytes > 8 * 80 * GIB * 0.9  # seed 003: 800 GB of bf16 for 640 GB
    assert bf16.kv_bytes_per_gpu < 0 and bf16.tokens == 0
    assert "does not fit" in describe_deployment(bf16, 16384)
    fp8 = deployment(kv, 80, tensor_parallel_size=8, quantization="fp8")
    int4 = deployment(kv, 80, tensor_parallel_size=8, quantization="int4")
    assert fp8.weight_bytes_per_gpu == pytest.approx(fp8.weight_bytes / 8)
    # 8 KV heads on 8 GPUs: one head each, 1/8 of a token's KV per GPU.
    assert fp8.kv_heads_per_gpu == 1
    assert fp8.kv_bytes_per_token_per_gpu * 8 == kv.bytes_per_token
    assert 0 < fp8.sequences(16384) < int4.sequences(16384)
    assert "sequences at 16,384 tokens each" in describe_deployment(fp8, 16384)


def test_more_gpus_than_kv_heads_replicates_them():
    kv = kv_size("llama-3-8b")  # 8 KV heads
    eight = deployment(kv, 80, tensor_parallel_size=8)
    sixteen = deployment(kv, 80, tensor_parallel_size=16)
    assert sixteen.kv_heads_per_gpu == eight.kv_heads_per_gpu == 1
    assert sixteen.kv_bytes_per_token_per_gpu == eight.kv_bytes_per_token_per_gpu
    assert sixteen.weight_bytes_per_gpu == pytest.approx(eight.weight_bytes_per_gpu / 2)
    assert "replicated" in describe_deployment(sixteen, 8192)


@pytest.mark.parametrize("kwargs, field", [
    ({"tensor_parallel_size": 3}, "tensor_parallel_size 3"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"quantization": "nf4"}, "quantization"),
    ({"quantization": "int4", "group_size": 48}, "quantization_group_size"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"gpu_memory_gib": 0}, "gpu_memory_gib"),
    ({"gpu_memory_gib": float("inf")}, "gpu_memory_gib"),
])
def test_bad_plans_are_refused_by_name(kwargs, field):
    args = {"gpu_memory_gib": 80, **kwargs}
    with pytest.raises(ValueError, match=field):
        deployment(kv_size("llama-3-8b"), **args)


def test_a_checkpoint_folder_needs_a_preset_for_weights():
    from dataclasses import replace
    with pytest.raises(ValueError, match="parameter count"):
        deployment(replace(kv_size("llama-3-8b"), name="mine"), 80)


def test_cli_answers_per_gpu(capsys):
    assert main(["llama-3.1-405b", "--dtype", "bfloat16", "--gpu-memory-gib", "80",
                 "--tensor-parallel-size", "8", "--quantization", "int4",
                 "--context", "16384"]) == 0
    out = capsys.readouterr().out
    assert "per GPU on 8" in out and "sequences at 16,384 tokens each" in out
    # Weights per GPU need the GPU's size.
    assert main(["llama-3-8b", "--quantization", "int8"]) == 2
    assert "--gpu-memory-gib" in capsys.readouterr().err
