"""Every kernel launch the engine makes compiles for sm_80 and sm_90, on a machine without a GPU.

The interpreter tests check what the kernels compute; this checks that a GPU compiler accepts
them and that each program fits a multiprocessor's shared memory. The lessons' Triton exercises
(lessons/exercises/solutions: the kernels a learner writes) are compiled with them. Both phases of
``pagedllm.kernels.compile_check`` run as fresh processes, as they must: one records the launches
under the interpreter, the other compiles them (a process that interpreted kernels cannot
compile). The record phase runs the ``ci`` matrix, the ``full`` one's paths in fewer launches;
``PAGEDLLM_COMPILE_CHECK_MATRIX=full`` runs the full one (many minutes on two cores).

The last test shows the check catching what the interpreter lets through: an fp16 ``tl.dot`` on
8 x 8 tiles, which the interpreter computes (numpy multiplies any shape) and the compiler
rejects (a matrix product needs K >= 16), and a kernel calling a plain Python function.
"""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

from pagedllm.kernels.compile_check import (  # noqa: E402
    EXERCISES,
    TARGETS,
    exercise_kernels,
    jit_functions,
    launched_kernels,
)

CAPABILITIES = (80, 90)
MATRIX = os.environ.get("PAGEDLLM_COMPILE_CHECK_MATRIX", "ci")
JOBS = str(min(os.cpu_count() or 1, 4))


def run_phase(*args, env=None, check=True):
    """`python -m pagedllm.kernels.compile_check ...` in a fresh process."""
    env = {k: v for k, v in (env or os.environ).items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "pagedllm.kernels.compile_check", *args],
                          env=env, capture_output=True, text=True)
    if check and done.returncode != 0:
        pytest.fail(f"compile_check {' '.join(args)} exited {done.returncode}\n"
                    f"{done.stdout[-6000:]}\n{done.stderr[-3000:]}")
    return done


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """Record (the interpreter, in subprocesses), then compile (a fresh process)."""
    tmp = tmp_path_factory.mktemp("compile_check")
    launches, results = tmp / "launches.json", tmp / "report.json"
    run_phase("record", "--matrix", MATRIX, "--jobs", JOBS, "--launches", str(launches))
    done = run_phase("compile", "--launches", str(launches), "--json", str(results),
                     "--targets", ",".join(map(str, CAPABILITIES)), "--jobs", JOBS, check=False)
    print(done.stdout)  # the resource table, in pytest's captured output
    return {"launches": json.loads(launches.read_text()),
            **json.loads(results.read_text()), "stdout": done.stdout, "rc": done.returncode}


def test_every_jit_function_is_a_kernel_or_a_helper_of_one():
    """A kernel is what a launcher hands kernel_runner; every other @triton.jit function must be
    called from one (and is compiled inside it), or the record phase could miss a kernel."""
    kernels = launched_kernels()
    assert len(kernels) >= 9  # the seven ops, flash-decoding's combine, the hash's test kernel
    functions = jit_functions()
    for name in set(functions) - set(kernels):
        callers = "\n".join(fn.src for other, fn in functions.items() if other != name)
        assert re.search(rf"\b{name}\(", callers), f"{name}: @triton.jit, but nothing calls it"


def test_the_lessons_triton_exercises_are_kernels_to_compile():
    """The exercises' solutions: lesson 10's paged decode and lesson 13's store_kv."""
    assert EXERCISES.is_dir(), EXERCISES
    assert set(exercise_kernels()) == {"paged_decode_kernel", "store_kv_kernel"}
    assert not set(exercise_kernels()) & set(launched_kernels())  # one name, one kernel


def test_every_kernel_is_recorded(report):
    recorded = {launch["kernel"].split(":")[1] for launch in report["launches"]}
    kernels = set(launched_kernels()) | set(exercise_kernels())
    assert kernels <= recorded, f"never launched in the record phase: {kernels - recorded}"


def test_the_launches_are_the_gpus(report):
    """The launchers pass the interpreter a few things differently (compile_check.GPU_VIEW):
    the record holds what a GPU gets."""
    for launch in report["launches"]:
        if launch["kernel"].endswith(":_paged_attention_kernel"):
            assert launch["constexprs"]["DOT_F32"] is False
        if launch["kernel"].endswith(":_sample_kernel"):
            assert launch["constexprs"]["LIBDEVICE"] is True
            assert launch["options"]["num_warps"] in (4, 8)


def test_every_launch_compiles_for_sm80_and_sm90(report):
    failed = [r for r in report["results"] if not r["ok"] and "shared" not in r]
    assert not failed, "\n\n".join(
        f"{r['kernel']} for {r['target']}, constexprs {r['constexprs']}:\n{r['error']}"
        for r in failed)
    compiled = {(json.dumps(r["launch"], sort_keys=True), r["capability"])
                for r in report["results"]}
    for launch in report["launches"]:
        for capability in CAPABILITIES:
            assert (json.dumps(launch, sort_keys=True), capability) in compiled
    assert {r["kernel"] for r in report["results"]} == set(launched_kernels()) | set(
        exercise_kernels())


def test_no_program_overflows_shared_memory(report):
    over = [r for r in report["results"]
            if "shared" in r and r["shared"] > TARGETS[r["capability"]].smem_per_program]
    assert not over, "\n".join(
        f"{r['kernel']} on {r['target']}: {r['shared']} B of shared memory, constexprs "
        f"{r['constexprs']} (recorded in {r['case']})" for r in over)
    assert report["rc"] == 0, report["stdout"][-4000:]


def test_the_report_has_registers_and_occupancy(report):
    for r in report["results"]:
        if "shared" in r:  # compiled
            assert r["ptxas"] and r["registers"] > 0 and r["programs_per_sm"] >= 1, r
    for capability in CAPABILITIES:
        assert TARGETS[capability].arch in report["stdout"]


BROKEN = '''
import torch
import triton
import triton.language as tl

from pagedllm.kernels.runtime import kernel_runner


@triton.jit
def _small_dot_kernel(a_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tile = offs[:, None] * BLOCK + offs[None, :]
    a = tl.load(a_ptr + tile)
    tl.store(out_ptr + tile, tl.dot(a, a).to(tl.float16))


def _double(x):  # a plain Python function, not @triton.jit
    return x * 2


@triton.jit
def _python_call_kernel(a_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, _double(tl.load(a_ptr + offs)))


def run():
    """Both kernels under the interpreter: the largest error of each against torch."""
    a, out = torch.randn(8, 8).half(), torch.empty(8, 8).half()
    kernel_runner(_small_dot_kernel, a, out)[(1,)](a, out, BLOCK=8)
    b, out2 = torch.randn(16), torch.empty(16)
    kernel_runner(_python_call_kernel, b, out2)[(1,)](b, out2, BLOCK=16)
    return [float((out.float() - a.float() @ a.float()).abs().max()),
            float((out2 - 2 * b).abs().max())]
'''

RECORD_BROKEN = '''
import json, sys
from pagedllm.kernels.compile_check import Recorder
from pagedllm.kernels.runtime import launch_hook
import broken_kernels
recorder = Recorder()
recorder.case = "deliberately broken"
with launch_hook(recorder):
    errors = broken_kernels.run()
json.dump({"errors": errors, "launches": list(recorder.launches.values())}, sys.stdout)
'''


def test_a_kernel_the_interpreter_accepts_but_the_compiler_rejects_fails(tmp_path):
    (tmp_path / "broken_kernels.py").write_text(textwrap.dedent(BROKEN))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-c", RECORD_BROKEN], capture_output=True,
                          text=True, env={**env, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr
    recorded = json.loads(done.stdout)
    assert recorded["errors"][0] < 0.05 and recorded["errors"][1] == 0  # the interpreter: fine
    launches = tmp_path / "launches.json"
    launches.write_text(json.dumps(recorded["launches"]))

    result = run_phase("compile", "--launches", str(launches), "--targets", "80,90",
                       "--jobs", "1", "--json", str(tmp_path / "report.json"), env=env,
                       check=False)
    assert result.returncode == 1
    failures = result.stdout[result.stdout.index("FAILED"):]
    for capability in CAPABILITIES:
        assert f"_small_dot_kernel for {TARGETS[capability].arch}" in failures
        assert f"_python_call_kernel for {TARGETS[capability].arch}" in failures
    assert "K >= 16" in failures and "'BLOCK': 8" in failures  # the compiler's reason
    assert "_double" in failures
    results = json.loads((tmp_path / "report.json").read_text())["results"]
    assert len(results) == 4 and not any(r["ok"] for r in results)


RECORD_FP8 = '''
import json, sys, torch
from pagedllm.kernels.compile_check import Recorder
from pagedllm.kernels.quant_linear import quant_linear
from pagedllm.kernels.runtime import launch_hook
from pagedllm.reference.ops.weight_quant import quantize_fp8
recorder = Recorder()
with launch_hook(recorder):
    for dtype in (torch.bfloat16, torch.float16):
        qw = quantize_fp8((torch.randn(64, 256) * 0.05).to(dtype))
        for rows in (3, 40):
            quant_linear(torch.randn(rows, 256).to(dtype), qw)
json.dump(list(recorder.launches.values()), open(sys.argv[1], "w"))
'''


def test_the_fp8_weight_product_compiles_for_sm80_and_sm90(tmp_path):
    """fp8 weights reach the kernel as bytes and are widened by bit arithmetic, so the A100
    (sm_80), whose Triton has no e4m3 type, compiles the launch as the H100 (sm_90) does. A
    focused record of the fp8 launches alone: the ci matrix above holds them too, but this
    one runs in seconds."""
    launches, results = tmp_path / "launches.json", tmp_path / "report.json"
    subprocess.run([sys.executable, "-c", RECORD_FP8, str(launches)], check=True,
                   env={**os.environ, "TRITON_INTERPRET": "1"})
    recorded = json.loads(launches.read_text())
    assert recorded and all(launch["constexprs"]["FP8"] for launch in recorded)
    assert all(launch["signature"]["w_ptr"] == "*u8" for launch in recorded)
    run_phase("compile", "--launches", str(launches), "--json", str(results),
              "--targets", ",".join(map(str, CAPABILITIES)), "--jobs", "1")
    report = json.loads(results.read_text())["results"]
    assert {r["capability"] for r in report} == set(CAPABILITIES)
    assert all(r["ok"] for r in report), [r["error"] for r in report if not r["ok"]]
