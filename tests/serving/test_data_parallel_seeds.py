"""Data-parallel replicas do not hand out the same random numbers (issue 38, item 3).

Each replica's engine draws a seed for every request that has none from its own seed stream;
built with the server's one ``--seed``, every replica's stream repeated the others', and four
identical unseeded requests over two replicas came out as two texts, each twice. Replica i's
engine seed is now ``replica_seed(--seed, i)`` (replica 0 keeps ``--seed``): identical unseeded
requests differ across replicas as they do on one, and a seeded request keeps its own seed,
giving the same tokens on every replica.
"""

import asyncio
import os
import subprocess
import sys

import openai
import pytest

from pagedllm.reference.engine.sampling_params import SamplingParams
from pagedllm.serving.api_server import ServerThread, build_app
from pagedllm.serving.data_parallel import (
    DataParallelEngine,
    DataParallelLLM,
    replica_args,
    replica_seed,
)
from pagedllm.serving.metrics import ServerMetrics

from .conftest import MODEL
from .test_data_parallel import metric, serve_args

PROMPT = "The with statement"
MAX_STEPS = 500  # a request of MAX_TOKENS tokens ends in far fewer engine steps
MAX_TOKENS = 24


def test_replica_seeds_are_splitmix64_outputs_of_the_server_seed():
    for seed in (0, 1, 12345, 2**64 - 1):
        assert replica_seed(seed, 0) == seed  # one replica: the server's seed, as before
        seeds = [replica_seed(seed, i) for i in range(16)]
        assert len(set(seeds)) == 16 and all(0 <= s < 2**64 for s in seeds)
    # SplitMix64's first three outputs from state 0 (its published test vector)
    assert [replica_seed(0, i) for i in (1, 2, 3)] == [
        0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    # a seed the engine refuses reaches it unchanged, so it refuses it with its own message
    for bad in (-1, 2**64, True, "7", None):
        assert replica_seed(bad, 1) is bad
    args = replica_args(serve_args("--seed", "9"), 1)
    assert args.seed == replica_seed(9, 1) and args.data_parallel_size == 2


def test_replica_seeds_are_the_same_in_every_process():
    """Arithmetic, not hash(): a fresh interpreter with another hash seed gets the same."""
    code = ("from pagedllm.serving.data_parallel import replica_seed; "
            "print([replica_seed(s, i) for s in (0, 77) for i in range(4)])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120,
                         env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout
    assert out.strip() == str([replica_seed(s, i) for s in (0, 77) for i in range(4)])


@pytest.fixture(scope="module")
def replicas():
    with DataParallelLLM(serve_args()) as llm:
        yield llm.replicas


def run_on(replica, request_id: str, params: SamplingParams) -> list[int]:
    """One request on one replica's engine, stepped until it ends (at most MAX_STEPS steps)."""
    replica.add_request(request_id, PROMPT, params)
    for _ in range(MAX_STEPS):
        for out in replica.step():
            if out.request_id == request_id and out.finished:
                return out.outputs[0].token_ids
    raise AssertionError(f"{request_id} did not end in {MAX_STEPS} steps")


def test_unseeded_identical_requests_differ_across_replicas_as_on_one(replicas):
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tokens = {(i, k): run_on(replica, f"unseeded-{i}-{k}", params)
              for i, replica in enumerate(replicas) for k in range(2)}
    assert tokens[0, 0] != tokens[0, 1]  # one replica: two draws, two answers
    # Across replicas too: the k-th unseeded request of each replica must not repeat the
    # other's (they did: both engines drew the same seeds from the same --seed).
    assert len({tuple(t) for t in tokens.values()}) == 4, tokens


def test_a_seeded_request_gives_the_same_tokens_on_every_replica(replicas, reference_llm):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = [run_on(replica, f"seeded-{i}", params) for i, replica in enumerate(replicas)]
    alone = reference_llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == [alone, alone]


def test_four_concurrent_identical_unseeded_requests_give_four_texts():
    """The issue's report, through the server: four concurrent identical unseeded requests
    at temperature 1 over two replicas (two each) give four texts, not two texts twice; two
    concurrent seeded ones (one each) give one text."""
    with DataParallelLLM(serve_args()) as llm:
        engine = DataParallelEngine(llm.replicas, ServerMetrics(MODEL))
        with ServerThread(build_app(engine, MODEL, root=llm.model_dir)) as server:
            client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none",
                                        max_retries=0, timeout=120)

            async def burst(count: int, **seed) -> list[str]:
                return [out.choices[0].text for out in await asyncio.gather(*(
                    client.completions.create(model=MODEL, prompt=PROMPT, temperature=1.0,
                                              max_tokens=MAX_TOKENS, **seed)
                    for _ in range(count)))]

            async def both() -> tuple[list[str], dict, list[str], dict]:
                try:
                    unseeded = await burst(4)
                    served = taken(server)
                    seeded = await burst(2, seed=99)
                    return unseeded, served, seeded, taken(server)
                finally:
                    await client.close()

            unseeded, served, seeded, served_after = asyncio.run(both())
    # the router spread each burst over both replicas (else this would prove nothing)
    assert served == {"0": 2, "1": 2}, served
    assert {k: served_after[k] - served[k] for k in served} == {"0": 1, "1": 1}
    assert len(set(unseeded)) == 4, unseeded
    assert seeded[0] == seeded[1]


def taken(server) -> dict[str, int]:
    """engine label -> requests it finished (stop or length)."""
    done = [metric(server, "request_success_total", finished_reason=reason)
            for reason in ("stop", "length")]
    return {engine: int(sum(d.get(engine, 0) for d in done)) for engine in set().union(*done)}
