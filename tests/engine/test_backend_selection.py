"""One backend per device, chosen once when the runner is built, and said op by op.

The optimized tier's runner picks ``TRITON_BACKEND`` on CUDA, the interpreted kernels under
``TRITON_INTERPRET=1`` and ``CPU_BACKEND`` on a plain CPU; a backend handed to the engine runs as
it is. ``LLM.kernels()`` and ``pagedllm env`` say what computes each op on this machine and why.
Ops are never recognised by identity: a swapped-in op is called, and the one-call decode step
(which computes the backend's own ops itself) steps aside for it.
"""

import functools
import gc
import platform
from dataclasses import replace

import pytest
import torch

from pagedllm import optimized
from pagedllm.kernels import cpu_ops
from pagedllm.optimized.attention import StepPlans
from pagedllm.optimized.backend import (
    CPU_BACKEND,
    INTERPRETED_BACKEND,
    TRITON_BACKEND,
    select_backend,
)
from pagedllm.reference import SamplingParams
from pagedllm.reference.engine.config import auto_quantized_dtype, native_bf16
from pagedllm.serving.cli import main as cli_main
from pagedllm.serving.env_cmd import cpu_flags

OPS = ("rms_norm", "store_kv", "rotary", "paged_attention", "silu_and_mul", "sample", "linear",
       "whole_step")
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 12, 1)]


def test_the_backend_is_chosen_from_the_device(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert select_backend(torch.device("cpu")) is CPU_BACKEND
    assert select_backend(torch.device("cuda")) is TRITON_BACKEND
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_backend(torch.device("cpu")) is INTERPRETED_BACKEND


@pytest.mark.skipif(cpu_ops.cpu_extension() is None or platform.system() != "Linux"
                    or platform.machine().lower() not in ("x86_64", "amd64"),
                    reason="the CPU kernels did not build, or this is not Linux on x86-64")
def test_the_kernels_best_path_is_what_linux_says_this_cpu_runs():
    """The extension's own CPUID check agrees with /proc/cpuinfo, which lists only what the
    CPU has and the kernel enables: a path chosen past it is an illegal instruction. (A CPU
    Linux lists with none of the flags, as QEMU's default model, must get the scalar path.)"""
    flags = set(cpu_flags())
    machine = cpu_ops.cpu_extension().machine_isa()
    if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"} <= flags:
        assert machine in (("amx", "avx512") if "amx_bf16" in flags else ("avx512",))
    elif {"avx2", "fma", "f16c"} <= flags:
        assert machine == "avx2"
    else:
        assert machine == "scalar"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernels_say_what_computes_each_op_here(checkpoints, dtype, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    llm = optimized.LLM(checkpoints["llama"], dtype=dtype, block_size=4)
    report = llm.kernels()
    assert set(OPS) <= set(report)
    isa = cpu_ops.cpu_isa()
    if isa is None:  # no build: every op says why it is the twin
        assert "twin" in report["rms_norm"]
    elif getattr(torch, dtype) in cpu_ops.FLOATS:
        vector = "avx512" if isa == "amx" else isa  # amx: AVX-512 but for the bf16 product
        assert f"{vector} path" in report["rms_norm"]
        assert f"{vector} path" in report["paged_attention"]
        assert f"int8, int4, fp8 and GGUF blocks: C++ kernels, {vector} path" in report["linear"]
        amx = isa == "amx" and dtype == "bfloat16"
        assert ("bf16 weights too, on AMX tiles" in report["linear"]) == amx
    assert llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # and the engine runs


def test_a_backend_handed_in_runs_as_it_is_and_is_reported_so(checkpoints):
    calls = {"n": 0}
    op = CPU_BACKEND.rms_norm

    @functools.wraps(op)
    def counted(*args, **kwargs):
        calls["n"] += 1
        return op(*args, **kwargs)

    plain = optimized.LLM(checkpoints["llama"], dtype="bfloat16", block_size=4)
    llm = optimized.LLM(checkpoints["llama"], dtype="bfloat16", block_size=4,
                        backend=replace(CPU_BACKEND, name="counted", rms_norm=counted))
    assert "as the engine was handed it" in llm.kernels()["every op"]
    # the one-call decode step computes the backend's own ops only: a swapped one runs
    assert llm.engine.runner.whole_step is None
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert calls["n"] > 0
    assert tokens == [o.outputs[0].token_ids
                      for o in plain.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_auto_dtype_of_a_quantized_model_follows_the_cpu(checkpoints):
    want = "bfloat16" if native_bf16() else "float32"
    assert auto_quantized_dtype(torch.device("cpu")) == want
    assert auto_quantized_dtype(torch.device("cuda")) == "bfloat16"
    llm = optimized.LLM(checkpoints["llama"], quantization="int8", block_size=4)
    assert llm.engine.config.dtype == getattr(torch, want)


def test_pagedllm_env_prints_the_machine_and_each_op(capsys):
    assert cli_main(["env", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "CPU kernels:" in out and "dtype='auto'" in out
    for op in ("rms_norm", "paged_attention", "linear", "whole_step"):
        assert op in out


def test_step_plans_compute_once_per_step_and_never_serve_a_stale_value():
    plans, made = StepPlans(), []

    def make():
        made.append(1)
        return len(made)

    anchor, table = torch.tensor([3, 5]), torch.zeros(2, 4)
    assert plans.get(anchor, (table, 16), make) == 1
    assert plans.get(anchor, (table, 16), make) == 1  # a later layer finds it
    assert plans.get(anchor, (table, 8), make) == 2  # another block size
    assert plans.get(anchor, (table, 16), make) == 1  # both kept: a hybrid step alternates
    table[0, 0] = 7  # changed in place: its version moved on
    assert plans.get(anchor, (table, 8), make) == 3
    assert plans.get(anchor, (table.clone(), 8), make) == 4  # another tensor, equal values
    anchor.add_(1)
    assert plans.get(anchor, (table, 8), make) == 5
    del anchor
    gc.collect()
    assert not plans.entries  # the step's tensor gone, its entry with it
