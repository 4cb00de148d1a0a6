"""Shared fixtures: small random-weight checkpoints of every family, written once per session."""

import functools
import importlib
from dataclasses import replace

import pytest
import torch

from pagedllm.reference.model.random_checkpoint import tiny_config, write_random_checkpoint
from pagedllm.reference.ops import REFERENCE_BACKEND

FAMILIES = ("llama", "llama3", "mistral", "qwen2", "qwen3", "opt")

# N(0, 0.2) weights give logits with a spread of about 1.6, like a trained model's, instead of the
# near-flat logits (spread ~0.16) of the usual 0.02: the gap between the best and second-best
# token is then far above float32 reordering noise (~1e-5), so greedy comparisons are decisive.
INIT_STD = 0.2

# The engine-level tests run once per tier through the `tier` fixture: every tier exports the same
# public API (LLM, LLMEngine, SamplingParams, BeamSearchParams) and must give the same results.
TIERS = ["reference", "optimized"]


def baseline_refusal(tier, message: str) -> str:
    """The error a tier gives to a contiguous-slab or static-batching configuration: the
    reference tier checks it (its own message); the optimized tier refuses the baselines."""
    return message if tier.__name__ == "pagedllm.reference" else "the reference tier's"


@pytest.fixture(scope="module", params=TIERS, ids=TIERS)
def tier(request):
    """The tier's package, `pagedllm.<tier>`: use tier.LLM, tier.SamplingParams, ..."""
    return importlib.import_module(f"pagedllm.{request.param}")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("checkpoints")
    return {family: write_random_checkpoint(root / family, tiny_config(family), seed=0,
                                            init_std=INIT_STD)
            for family in FAMILIES}


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)


def failing_backend(op: str, after: int, backend=REFERENCE_BACKEND):
    """The backend, except that op raises on its call number `after` (and only then). A runner
    calls a swapped-in op as it is: on the CPU the optimized runner then attends through the
    generic context, which calls this op, instead of its planned path."""
    calls = {"n": 0}
    original = getattr(backend, op)

    @functools.wraps(original)
    def broken(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == after:
            raise RuntimeError(f"injected failure in {op}")
        return original(*args, **kwargs)

    return replace(backend, **{op: broken})
