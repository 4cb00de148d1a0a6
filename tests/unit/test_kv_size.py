"""The KV size calculator reproduces the published per-token sizes."""

import subprocess
import sys

import pytest

from pagedllm.reference.kv_size import PRESETS, kv_size


def test_opt_13b_matches_the_paper():
    s = kv_size("opt-13b")
    assert s.bytes_per_token == 819_200  # 2 x 40 layers x 5120 hidden x 2 bytes
    assert s.bytes_for(2048) / 2**20 == 1600  # the paper's "1.6 GB" per 2048-token request


def test_gqa_shrinks_the_cache():
    assert kv_size("llama-3-8b").bytes_per_token == 2 * 32 * 8 * 128 * 2  # 131,072
    assert kv_size("llama-2-7b").bytes_per_token == 4 * kv_size("llama-3-8b").bytes_per_token
    assert kv_size("qwen2.5-7b").bytes_per_token == 57_344
    assert kv_size("opt-13b", "float32").bytes_per_token == 2 * 819_200


def test_checkpoint_folder(checkpoints):
    s = kv_size(checkpoints["llama3"])  # 2 layers, 2 KV heads of 16, float32
    assert s.bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert s.tokens_per_gib == 2**30 // 512


def test_command_prints_the_paper_numbers():
    out = subprocess.run([sys.executable, "-m", "pagedllm.reference.kv_size", "opt-13b",
                          "--tokens", "2048"], capture_output=True, text=True, check=True).stdout
    assert "bytes per token: 819,200" in out
    assert "1,600 MiB" in out and "1.68 GB" in out


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="neither a preset nor a folder") as err:
        kv_size("gpt-5")
    assert "opt-13b" in str(err.value)
    with pytest.raises(ValueError, match="not a torch dtype"):
        kv_size("opt-13b", "fp17")
    assert len(PRESETS) >= 10


def test_a_sliding_window_costs_at_most_its_window():
    s = kv_size("mistral-7b")  # v0.1: every layer reads the last 4,096 tokens
    assert s.sliding_window == 4096
    assert s.held_blocks(32_768) == 4096 // 16 + 1 == 257  # not 2,048 blocks
    assert s.held_blocks(100) == 7  # shorter than the window: its own blocks
    assert kv_size("llama-3-8b").held_blocks(32_768) == 2048
    out = subprocess.run([sys.executable, "-m", "pagedllm.reference.kv_size", "mistral-7b",
                          "--tokens", "32768"], capture_output=True, text=True, check=True).stdout
    assert "sliding window 4,096: a sequence holds at most 257 blocks of 16" in out
    assert f"{257 * 16 * s.bytes_per_token:,} bytes" in out


def test_a_windowed_checkpoint_is_priced_by_its_window(checkpoints):
    s = kv_size(checkpoints["mistral"])  # window 16
    assert s.sliding_window == 16 and s.held_blocks(200, block_size=4) == 5
    assert kv_size(checkpoints["llama"]).sliding_window is None


def test_each_kind_is_described_once():
    """One window over every layer: the window's line; windowed and full layers: the groups'
    line; a latent: the four kinds of attention over its layers."""
    from pagedllm.reference.kv_size import describe

    mistral = describe(kv_size("mistral-7b"), 32_768)
    assert "sliding window 4,096" in mistral and "KV cache groups" not in mistral
    gemma = describe(kv_size("gemma-3-27b"), 32_768)
    assert "7 KV cache groups of 10 layers (6 windowed, 1 full)" in gemma
    assert "2,438 blocks of 16" in gemma and "sliding window" not in gemma
    latent = describe(kv_size("deepseek-v2"), 4096)
    assert "one latent row of 576" in latent and "56.89x MLA" in latent
