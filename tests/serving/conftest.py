"""Servers for the serving tests: the tiny model behind the HTTP API on loopback, in a thread.

One LLM (optimized tier, the server's default) is loaded per session; each test module starts
its own server on it and stops it at the module's end, so only one server steps the engine at a
time. ``reference_llm`` is a second, separate LLM of the same model for "the same request run
alone through LLM.generate".
"""

import openai
import pytest

from pagedllm.optimized import LLM
from pagedllm.serving.api_server import ServerThread, build_app
from pagedllm.serving.default_model import default_model_dir

MODEL = "tiny-pydoc"


@pytest.fixture(scope="session")
def served_llm():
    return LLM(default_model_dir(), seed=0)


@pytest.fixture(scope="session")
def reference_llm():
    return LLM(default_model_dir(), seed=0)


@pytest.fixture(scope="module")
def server(served_llm):
    with ServerThread(build_app(served_llm, MODEL)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                         timeout=60)


def wait_until_idle(server, timeout: float = 20.0) -> dict:
    """The engine's stats once it holds no request (the snapshot the engine thread keeps)."""
    import time

    engine = server.app.state.engine
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine.stats
        if stats["running"] == stats["waiting"] == stats["swapped"] == 0:
            return stats
        time.sleep(0.05)
    raise AssertionError(f"the engine is still busy after {timeout} s: {engine.stats}")
