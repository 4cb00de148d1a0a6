"""The real vLLM as a benchmark system (benchmarks/systems.py's vllm_cpu, the runner
benchmarks/vllm_cpu.py, throughput_cpu.py's vLLM row), without vLLM: a venv that is absent
gives a row that says how to install it; a stand-in "python" that answers the runner's JSON
protocol exercises the parsing, the ratio and the token comparison; the runner itself runs
under a stand-in vllm package. Nothing here needs the network or vLLM; the times the stand-ins
report are made up, so every number asserted is exact."""

import ast
import json
import os
import stat
import sys
import textwrap
from pathlib import Path

import pytest

from pagedllm.benchmarks import systems, throughput_cpu
from pagedllm.optimized import LLM as OptimizedLLM
from pagedllm.reference.model.random_checkpoint import tiny_config, write_random_checkpoint

RUNNER = Path(systems.__file__).with_name("vllm_cpu.py")
WORK = [([5, 6, 7, 8, 9], 4), ([10, 11, 12], 6), ([3, 4], 3)]


def executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


# A stand-in for the vLLM venv's python: it answers the runner's protocol (argv: runner,
# REQUEST.json, RESULT.json), keeps the request it got beside itself, and generates from
# ANSWERS.json (a request's prompt, as a string, to its tokens) or else token i = prompt[0] + i.
# Each run's wall time is 1 s + 10 ms a token, its CPU time twice that: made-up, exact numbers.
FAKE = textwrap.dedent("""\
    #!{python}
    import json, pathlib, sys
    runner, asked, answer = sys.argv[1:4]
    here = pathlib.Path(__file__).parent
    request = json.loads(pathlib.Path(asked).read_text())
    (here / "request.json").write_text(json.dumps({{"runner": runner, **request}}))
    answers = here / "ANSWERS.json"
    answers = json.loads(answers.read_text()) if answers.is_file() else {{}}
    runs = []
    for work in request["workloads"]:
        tokens = [answers.get(str(p), [p[0] + i for i in range(n)]) for p, n in work]
        made = sum(len(t) for t in tokens)
        runs.append({{"tokens": tokens, "wall": 1.0 + 0.01 * made, "cpu": 2.0 + 0.02 * made,
                     "partial": False, "made": made}})
    print("a log line vLLM would print")
    pathlib.Path(answer).write_text(json.dumps({{"ok": True, "vllm": "0.0-fake",
        "torch": "fake", "cores": [0], "runs": runs}}))
""")


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch) -> Path:
    """A vLLM venv whose python is the stand-in; returns its bin folder."""
    venv = tmp_path / "vllm-venv"
    executable(venv / "bin" / "python", FAKE.format(python=sys.executable))
    monkeypatch.setenv(systems.VLLM_VENV_ENV, str(venv))
    return venv / "bin"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    cfg = tiny_config("llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256)
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", cfg, seed=0,
                                   init_std=0.2)


def test_absent_vllm_is_a_row_that_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv(systems.VLLM_VENV_ENV, str(tmp_path / "no-such-venv"))
    result, tokens = systems.attempt(lambda: systems.vllm_cpu(
        WORK, tmp_path, batch=4, max_len=64, threads=1), WORK)
    assert tokens is None and not result["ok"]
    assert "bash benchmarks/install_vllm_cpu.sh" in result["error"]
    assert systems.VLLM_VENV_ENV in result["error"] and "no-such-venv" in result["error"]
    assert Path(systems.VLLM_INSTALL.split()[-1]).name == "install_vllm_cpu.sh"
    assert (RUNNER.parent / "install_vllm_cpu.sh").is_file()


def test_the_default_venv_is_under_the_cache(monkeypatch):
    monkeypatch.delenv(systems.VLLM_VENV_ENV, raising=False)
    assert systems.vllm_venv() == Path.home() / ".cache" / "pagedllm" / "vllm-cpu-venv"


def test_the_protocol_round_trips_through_a_stand_in(fake_vllm, tmp_path):
    warm = [([5, 6], 2)]
    result, tokens = systems.attempt(lambda: systems.vllm_cpu(
        WORK, tmp_path / "model", dtype="bfloat16", batch=4, max_len=64, threads=1,
        warm=warm), WORK)
    asked = json.loads((fake_vllm / "request.json").read_text())
    assert Path(asked["runner"]) == RUNNER
    assert asked["model"] == str(tmp_path / "model") and asked["dtype"] == "bfloat16"
    assert (asked["max_num_seqs"], asked["max_model_len"], asked["threads"]) == (4, 64, 1)
    assert asked["warm"] == [[[5, 6], 2]] and asked["cap"] is None
    assert asked["workloads"] == [[[p, n] for p, n in WORK]]
    assert tokens == [[p[0] + i for i in range(n)] for p, n in WORK]
    made = sum(n for _, n in WORK)
    assert result["ok"] and result["output_tokens"] == made and not result["partial"]
    assert result["seconds"] == pytest.approx(1.0 + 0.01 * made)
    assert result["cpu_seconds"] == pytest.approx(2.0 + 0.02 * made)
    assert result["tokens_per_s"] == pytest.approx(made / (1.0 + 0.01 * made))
    assert result["vllm"] == "0.0-fake" and result["vllm_cores"] == [0]


def test_a_failed_runner_is_reported_with_its_log(tmp_path, monkeypatch):
    venv = tmp_path / "venv"
    monkeypatch.setenv(systems.VLLM_VENV_ENV, str(venv))
    executable(venv / "bin" / "python", "#!/bin/sh\necho 'vLLM could not load the model'\n"
               "exit 1\n")
    result, _ = systems.attempt(lambda: systems.vllm_cpu(
        WORK, tmp_path, batch=4, max_len=64, threads=1), WORK)
    assert not result["ok"] and "wrote no result" in result["error"]
    assert "vLLM could not load the model" in result["error"]
    executable(venv / "bin" / "python", "#!/bin/sh\n"
               "echo '{\"ok\": false, \"error\": \"ValueError: no such dtype\"}' > \"$3\"\n")
    result, _ = systems.attempt(lambda: systems.vllm_cpu(
        WORK, tmp_path, batch=4, max_len=64, threads=1), WORK)
    assert not result["ok"] and "ValueError: no such dtype" in result["error"]


def test_the_race_prints_vllms_row_the_ratio_and_identical_requests(
        fake_vllm, checkpoint, capsys):
    """Ours against the stand-in, which answers ours' greedy tokens for two requests and other
    tokens for the third: 2 of 3 identical, and the ratio is ours' tok/s over the stand-in's."""
    work = [([1, 2, 3, 4, 5], 6), ([7, 8, 9], 5), ([11, 12, 13, 14], 4)]
    ours = systems.ours(work, OptimizedLLM, checkpoint, batch=4, max_len=64)
    answers = {str(p): t for (p, _), t in zip(work, ours.tokens, strict=True)}
    answers[str(work[2][0])] = [(t + 1) % 64 for t in ours.tokens[2]]
    (fake_vllm / "ANSWERS.json").write_text(json.dumps(answers))
    with throughput_cpu.torch_threads(1):
        results = throughput_cpu.race(checkpoint, work, batch=4, max_len=64,
                                      only=("optimized", "vllm"))
    throughput_cpu.print_table(results)
    printed = capsys.readouterr().out
    mine, vllm = results["optimized"], results["vllm"]
    assert vllm["ok"] and vllm["seconds"] == pytest.approx(1.0 + 0.01 * 15)
    assert mine["requests_identical_to_vllm"] == 2 and mine["requests"] == 3
    assert mine["ratio_to_vllm"] == pytest.approx(mine["tokens_per_s"] / vllm["tokens_per_s"])
    assert mine["cpu_ratio_to_vllm"] == pytest.approx(
        mine["tokens_per_cpu_s"] / vllm["tokens_per_cpu_s"])
    assert "requests_identical_to_vllm" not in vllm  # vLLM is not compared with itself
    assert "vLLM (vllm-cpu)" in printed and "x vLLM" in printed
    assert "identical to vLLM's at the same dtype (requests): ours, optimized tier: paged + " \
        "continuous 2/3" in printed
    asked = json.loads((fake_vllm / "request.json").read_text())
    assert asked["threads"] == 1 and asked["max_num_seqs"] == 4 and asked["dtype"] == "float32"


def test_quantized_rows_are_measured_against_vllms_fastest_row():
    """A row at a float dtype against vLLM at that dtype; a quantized row against vLLM's best
    scheme: bf16 where the CPU has it natively, float32 where vLLM's bf16 is emulated."""
    rows = {"vllm": {"ok": True, "tokens_per_s": 50.0},
            "vllm#bfloat16": {"ok": True, "tokens_per_s": 90.0}}
    assert throughput_cpu.vllm_row("optimized", rows) == "vllm"
    assert throughput_cpu.vllm_row("optimized#bfloat16", rows) == "vllm#bfloat16"
    assert throughput_cpu.vllm_row("optimized#int4", rows) == "vllm#bfloat16"
    assert throughput_cpu.vllm_row("llama_cpp", rows) == "vllm#bfloat16"
    assert throughput_cpu.vllm_row("vllm#bfloat16", rows) is None
    avx2 = {"vllm": {"ok": True, "tokens_per_s": 20.0},
            "vllm#bfloat16": {"ok": True, "tokens_per_s": 9.0}}
    assert throughput_cpu.vllm_row("optimized#gguf", avx2) == "vllm"
    assert throughput_cpu.vllm_row("optimized#bfloat16", avx2) == "vllm#bfloat16"
    assert throughput_cpu.vllm_row("optimized#int4", {"vllm": {"ok": True}}) == "vllm"
    assert throughput_cpu.vllm_row("optimized", {"vllm": {"ok": False}}) is None
    # a float32 row is never measured against vLLM's bf16, nor its tokens compared with it
    only_bf16 = {"vllm": {"ok": False}, "vllm#bfloat16": {"ok": True, "tokens_per_s": 9.0}}
    assert throughput_cpu.vllm_row("optimized", only_bf16) is None
    assert throughput_cpu.vllm_row("optimized#bfloat16", {"vllm": {"ok": True}}) == "vllm"
    # the 16-sequence column picks vLLM's fastest by its own speed
    columns = {"vllm": {"ok": True, "decode_tokens_per_s": 20.0, "batched": 100.0},
               "vllm#bfloat16": {"ok": True, "decode_tokens_per_s": 9.0, "batched": 300.0}}
    assert throughput_cpu.vllm_row("optimized#int8", columns, "decode_tokens_per_s") == "vllm"
    assert throughput_cpu.vllm_row("optimized#int8", columns, "batched") == "vllm#bfloat16"


def test_one_sequence_alone_has_vllms_rows(fake_vllm, checkpoint, capsys):
    """The stand-in's clocks: 1 s + 10 ms a token, so decode rates are exactly 100 tok/s."""
    work = [([1, 2, 3, 4, 5], 6)]
    with throughput_cpu.torch_threads(1):
        single = throughput_cpu.single_sequence(checkpoint, work, 256, ["float32"], 1e10,
                                                llama=False, vllm_dtypes=["float32"],
                                                params=1000)
    throughput_cpu.print_single(single)
    printed = capsys.readouterr().out
    vllm = single["vllm"]
    assert vllm["ok"] and vllm["decode_tokens_per_s"] == pytest.approx(100.0)
    assert vllm["batched_decode_tokens_per_s"] == pytest.approx(100.0)
    assert vllm["decode_tokens_per_cpu_s"] == pytest.approx(50.0)
    assert vllm["weight_bytes"] == 4000
    asked = json.loads((fake_vllm / "request.json").read_text())
    lengths = [[n for _, n in w] for w in asked["workloads"]]
    batched = throughput_cpu.BATCHED
    assert lengths == [[1], [129], [1] * batched, [129] * batched]
    ours = single["optimized#float32"]["decode_tokens_per_s"]
    assert f"{ours / 100.0:.2f}x" in printed and "vLLM (vllm-cpu)" in printed


# -- the runner, under a stand-in vllm package ------------------------------------------------
FAKE_VLLM_PACKAGE = {
    "vllm/__init__.py": textwrap.dedent("""\
        import json, os
        __version__ = "0.0-stand-in"
        ENV = {k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS",
                                              "VLLM_CPU_KVCACHE_SPACE")}

        class SamplingParams:
            def __init__(self, **kw):
                self.__dict__.update(kw)

        class _Out:
            def __init__(self, rid, tokens, finished):
                self.request_id, self.finished = rid, finished
                self.outputs = [type("Completion", (), {"token_ids": list(tokens)})()]

        class _Engine:
            def __init__(self):
                self.live, self.engine_core = {}, self
                self.shut = False

            def add_request(self, rid, prompt, params):
                assert params.temperature == 0.0 and params.ignore_eos
                internal = rid + "-abcd1234"  # vLLM appends a random suffix
                self.live[internal] = (prompt["prompt_token_ids"], params.max_tokens, [])
                return internal

            def has_unfinished_requests(self):
                return bool(self.live)

            def step(self):  # one token for every live request, the newest request first
                outs = []
                for rid in reversed(list(self.live)):
                    prompt, n, made = self.live[rid]
                    made.append((prompt[0] + len(made)) % 97)
                    outs.append(_Out(rid, made, len(made) == n))
                    if len(made) == n:
                        del self.live[rid]
                return outs

            def abort_request(self, ids):
                for rid in ids:
                    self.live.pop(rid, None)

            def shutdown(self):
                path = os.environ.get("STAND_IN_SHUTDOWN")
                if path:
                    open(path, "w").write(json.dumps(ENV))

        class LLM:
            def __init__(self, **kw):
                assert kw["enable_prefix_caching"] is False and kw["skip_tokenizer_init"]
                self.kw, self.llm_engine = kw, _Engine()
        """),
    "vllm/inputs.py": "def TokensPrompt(prompt_token_ids):\n"
                      "    return {'prompt_token_ids': prompt_token_ids}\n",
}


@pytest.fixture
def stand_in_runner(tmp_path, monkeypatch) -> None:
    """A vLLM venv whose python is ours, with the stand-in vllm package on its path: the real
    runner (benchmarks/vllm_cpu.py) runs under it."""
    for name, text in FAKE_VLLM_PACKAGE.items():
        (tmp_path / "pkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / name).write_text(text)
    venv = tmp_path / "venv"
    executable(venv / "bin" / "python",
               f"#!/bin/sh\nPYTHONPATH={tmp_path / 'pkg'} exec {sys.executable} \"$@\"\n")
    monkeypatch.setenv(systems.VLLM_VENV_ENV, str(venv))


def test_the_runner_speaks_the_protocol(stand_in_runner, tmp_path, monkeypatch):
    """benchmarks/vllm_cpu.py itself, run by a python that finds a stand-in vllm package: the
    request in, each request's tokens back in the workload's order (the stand-in answers out of
    order, under vLLM's suffixed ids), the threads bound, the engine shut down."""
    monkeypatch.setenv("STAND_IN_SHUTDOWN", str(tmp_path / "shutdown.json"))
    result = systems.vllm_runs([WORK, WORK[:1]], tmp_path, dtype="float32", batch=4,
                               max_len=64, threads=1, warm=[([1, 2], 2)], kv_cache_gib=0.5)
    assert result["vllm"] == "0.0-stand-in" and len(result["runs"]) == 2
    expected = [[(p[0] + i) % 97 for i in range(n)] for p, n in WORK]
    first, second = result["runs"]
    assert first["tokens"] == expected and second["tokens"] == expected[:1]
    assert first["made"] == sum(n for _, n in WORK) and not first["partial"]
    assert first["wall"] >= 0 and first["cpu"] >= 0
    cores = sorted(os.sched_getaffinity(0))[:1]
    assert result["cores"] == cores
    env = json.loads((tmp_path / "shutdown.json").read_text())  # shut down, with these set
    assert env == {"VLLM_CPU_OMP_THREADS_BIND": str(cores[0]), "OMP_NUM_THREADS": "1",
                   "VLLM_CPU_KVCACHE_SPACE": "1"}


def test_the_runner_stops_at_its_cap(stand_in_runner, tmp_path):
    """A cap of 0 s: the first step's tokens come back as a partial run, the rest aborted."""
    measured = systems.vllm_cpu(WORK, tmp_path, batch=4, max_len=64, threads=1, cap=0.0)
    assert measured.partial and measured.made == len(WORK)  # one token each, then stopped
    assert measured.tokens == [[], [], []]


def test_the_runner_imports_nothing_of_pagedllm():
    """It runs in vLLM's venv, which has no pagedllm and another torch: the standard library,
    vLLM and what vLLM installs, nothing else."""
    imported = set()
    for node in ast.walk(ast.parse(RUNNER.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module)
    assert imported <= {"json", "math", "os", "sys", "time", "traceback", "psutil", "torch",
                        "vllm", "vllm.inputs"}, imported
