"""Servers for the serving tests: the tiny model behind the HTTP API on loopback, in a thread.

One LLM (optimized tier, the server's default) is loaded per session; each test module starts
its own server on it and stops it at the module's end, so only one server steps the engine at a
time. ``reference_llm`` is a second, separate LLM of the same model for "the same request run
alone through LLM.generate".
"""

import time

import openai
import pytest

from pagedllm.optimized import LLM
from pagedllm.serving.api_server import ServerThread, build_app
from pagedllm.serving.async_engine import AsyncLLMEngine
from pagedllm.serving.default_model import default_model_dir
from pagedllm.serving.metrics import ServerMetrics

MODEL = "tiny-pydoc"
HANG_GUARD_S = 300.0  # only a hang runs this long: see wait_for


def app_for(llm, name: str = MODEL, **options):
    """The app around an LLM of either tier, as ``pagedllm serve`` builds it: an AsyncLLMEngine
    stepping the LLM's engine, with the server's metrics."""
    engine = AsyncLLMEngine(llm.engine, ServerMetrics(name))
    return build_app(engine, name, root=str(llm.model_dir), **options)


@pytest.fixture(scope="session")
def served_llm():
    return LLM(default_model_dir(), seed=0)


@pytest.fixture(scope="session")
def reference_llm():
    return LLM(default_model_dir(), seed=0)


@pytest.fixture(scope="module")
def server(served_llm):
    with ServerThread(app_for(served_llm)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                         timeout=60)


def wait_for(condition, what: str) -> None:
    """Poll until condition() holds. The tests bound steps, tokens and events, never this
    machine's speed: the guard only keeps a hang (a condition that never comes) from hanging
    the suite, so it is far longer than any loaded machine needs."""
    guard = time.monotonic() + HANG_GUARD_S
    while not condition():
        if time.monotonic() > guard:
            raise AssertionError(f"{what} never happened in {HANG_GUARD_S:g} s: hung?")
        time.sleep(0.01)


def wait_until_idle(server, max_steps: int = 2000) -> dict:
    """The engine's stats once it holds no request (the snapshot the engine thread keeps).
    The requests in flight must end within max_steps engine steps, however slow the steps."""
    engine = server.app.state.engine
    start, idle = engine.steps, {}

    def holds_none() -> bool:
        stats = engine.stats
        if stats["running"] == stats["waiting"] == stats["swapped"] == 0:
            idle.update(stats)
            return True
        if engine.steps - start > max_steps:
            raise AssertionError(f"the engine is still busy after {max_steps} steps: {stats}")
        return False

    wait_for(holds_none, "the engine holding no request")
    return idle
