"""The engine core's boundaries (issue 36), checked on the source and on a built engine:

- engine.py is about the step: it imports nothing of tensor parallelism and stays short;
- after a step, only the scheduler (and what it calls with the KV manager) changes KV
  bookkeeping: no other module of the engine calls a KV manager's verbs that change it;
- the runner owns the KV tensors: it allocates the pool the engine sized, with its spec's bytes.
"""

import ast
from pathlib import Path

import pytest

from pagedllm.reference.engine import LLMEngine

ENGINE = Path(__file__).resolve().parents[2] / "reference" / "engine"
# KV manager verbs that change who holds which slots
KV_WRITES = {"admit", "allocate_slots", "truncate_slots", "free", "free_seq", "fork",
             "swap_out", "swap_in", "mark_computed"}
# Where the post-step's KV changes may live: the scheduler, and beam search's step, which the
# scheduler calls with its KV manager.
KV_WRITERS = {"scheduler.py", "beam_step.py"}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            names.add(("." * node.level) + (node.module or ""))
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_engine_py_is_about_the_step():
    path = ENGINE / "engine.py"
    parallel = [name for name in _imports(path)
                if "parallel" in name or "distributed" in name or "torchrun" in name]
    assert not parallel, f"engine.py imports tensor parallelism: {parallel}"
    assert len(path.read_text().splitlines()) < 300


def _kv_writes(path: Path) -> list[str]:
    """Calls of the form <...>.kv.<verb>(...) or kv.<verb>(...) that change KV bookkeeping."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in KV_WRITES):
            owner = node.func.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if name == "kv":
                found.append(f"{path.name}:{node.lineno} kv.{node.func.attr}")
    return found


def test_only_the_scheduler_changes_kv_bookkeeping():
    writes = [w for path in sorted(ENGINE.rglob("*.py")) if path.name not in KV_WRITERS
              for w in _kv_writes(path)]
    assert not writes, f"KV bookkeeping changed outside the scheduler: {writes}"
    # and the check finds what it looks for
    assert _kv_writes(ENGINE / "scheduler.py") and _kv_writes(ENGINE / "beam_step.py")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_the_runner_allocates_the_pool_the_engine_sized(tier, checkpoints, kv_cache_dtype):
    llm = tier.LLM(model=str(checkpoints["llama"]), block_size=4, num_gpu_blocks=20,
                   swap_space_blocks=6, kv_cache_dtype=kv_cache_dtype)
    engine: LLMEngine = llm.engine
    config = engine.kv_cache_config
    (group,) = config.kv_cache_groups
    assert (config.num_blocks, config.num_cpu_blocks, config.block_size) == (20, 6, 4)
    assert group.layer_ids == tuple(range(engine.config.model_config.num_layers))
    pool = engine.runner.cache_engine
    assert pool.gpu_k[0].shape[:3] == (20, 4, group.kv_cache_spec.num_kv_heads)
    assert pool.cpu_k[0].shape[0] == 6
    assert llm.stats()["kv_cache_bytes"] == pool.nbytes() == config.bytes_per_block * 20


def test_the_engine_is_an_engine_client(tier, checkpoints):
    """What a front end may use of an engine, and nothing else (serving's replicas implement
    the same protocol)."""
    from pagedllm.reference.engine import EngineClient, ModelLimits

    llm = tier.LLM(model=str(checkpoints["llama"]), max_model_len=64, max_logprobs=5)
    engine = llm.engine
    assert isinstance(engine, EngineClient)
    assert engine.limits == ModelLimits(64, engine.config.model_config.vocab_size, 5)
    params = tier.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": [1, 2, 3]}, params)
    engine.add_request("b", {"prompt_token_ids": [4, 5]}, params)
    assert engine.has_request("a") and engine.has_unfinished_requests()
    engine.abort_request("a")
    assert not engine.has_request("a") and engine.has_request("b")
    while engine.has_unfinished_requests():
        engine.step()
    assert not engine.has_request("b") and engine.stats()["blocks_used"] == 0
