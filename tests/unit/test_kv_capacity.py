"""The KV capacity planner: contiguous versus paged sequences in a budget, context per user."""

import pytest

from pagedllm.reference.kv_size import (
    GIB,
    context_per_user,
    contiguous_capacity,
    kv_size,
    main,
    paged_capacity,
    plan,
)

OPT_13B = kv_size("opt-13b")


def test_contiguous_reserves_the_full_context():
    # 12 GiB of KV on an A100-40GB = 15,728 slots: seven 2048-token slabs (the paper's setup).
    assert contiguous_capacity(OPT_13B, 12 * GIB, 2048) == 7
    assert contiguous_capacity(OPT_13B, 12 * GIB, 1024) == 15
    assert contiguous_capacity(OPT_13B, 1 * GIB, 2048) == 0  # not even one full-length slab


def test_paged_holds_only_actual_tokens_in_whole_blocks():
    # 12 GiB = 983 blocks of 16; a 1024-token sequence holds 64 of them, a 1000-token one 63.
    assert paged_capacity(OPT_13B, 12 * GIB, mean_tokens=1024) == 983 // 64 == 15
    assert paged_capacity(OPT_13B, 12 * GIB, mean_tokens=1000) == 983 // 63
    assert paged_capacity(OPT_13B, 12 * GIB, mean_tokens=500, block_size=1) == 15_728 // 500
    for mean in (1, 17, 300, 2048):  # never fewer than contiguous reserving >= mean tokens
        assert paged_capacity(OPT_13B, 12 * GIB, mean) >= contiguous_capacity(
            OPT_13B, 12 * GIB, 2048)


def test_context_per_user_seed_004():
    # A 7B model (Llama-2-7B, 512 KiB per token) with 60 GiB left for KV, 160 users at once.
    llama = kv_size("llama-2-7b")
    assert context_per_user(llama, 60 * GIB, 160) == 768
    assert context_per_user(OPT_13B, 12 * GIB, 160) == 98
    assert context_per_user(OPT_13B, 12 * GIB, 1) == 15_728


def test_plan_in_words():
    text = plan(kv_size("llama-2-7b"), 60, context=4096, users=160)
    assert "122,880 token slots" in text
    assert "each reserves 4,096 tokens: 30 sequences" in text
    assert "sequences of 2,048 tokens on average: 60 sequences (2.0x)" in text  # default: half
    assert "160 users at once: at most 768 tokens of context each" in text
    assert "not even one token" in plan(OPT_13B, 0.001, users=160)


def test_command(capsys):
    assert main(["opt-13b", "--memory-gib", "12", "--mean-tokens", "500", "--users", "160"]) == 0
    out = capsys.readouterr().out
    assert "bytes per token: 819,200" in out  # the existing description still comes first
    assert "contiguous, each reserves 2,048 tokens: 7 sequences" in out
    assert "sequences of 500 tokens on average: 30 sequences" in out
    assert "at most 98 tokens of context each" in out
    assert main(["opt-13b"]) == 0 and "KV budget" not in capsys.readouterr().out


def test_pagedllm_kv_size_subcommand(capsys):
    from pagedllm.serving.cli import main as cli_main

    assert cli_main(["kv-size", "llama-2-7b", "--memory-gib", "60", "--users", "160"]) == 0
    assert "768 tokens of context each" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["opt-13b", "--users", "160"], "give the KV budget with --memory-gib"),
    (["opt-13b", "--memory-gib", "12", "--context", "4096"], "exceeds opt-13b's maximum"),
    (["opt-13b", "--memory-gib", "12", "--context", "100", "--mean-tokens", "200"],
     "mean_tokens 200 exceeds the context of 100"),
    (["opt-13b", "--memory-gib", "12", "--users", "0"], "users must be >= 1"),
    (["opt-13b", "--memory-gib", "12", "--context", "0"], "context must be >= 1"),
    (["opt-13b", "--memory-gib", "12", "--block-size", "0"], "block_size must be >= 1"),
    (["opt-13b", "--memory-gib", "-1"], "--memory-gib must be > 0"),
])
def test_bad_input(capsys, argv, message):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""  # nothing half-printed
