"""Many clients at once, and a client that leaves mid-stream."""

import asyncio
import json
import time

import httpx
import openai

from pagedllm.reference.engine.sampling_params import SamplingParams

from .conftest import MODEL, wait_for, wait_until_idle

PROMPTS = ["The for statement is used to", "Return a list of the", "This module provides",
           "An exception is raised when", "The default value of", "Read the file and"]


def request(i: int) -> dict:
    """Request i: mixed prompts, output lengths from 2 to 48 tokens, greedy or seeded."""
    return dict(prompt=PROMPTS[i % len(PROMPTS)] + " " * (i % 3), max_tokens=2 + (i * 7) % 47,
                temperature=0.0 if i % 2 else 0.8, seed=100 + i,
                stop=["\n\n"] if i % 4 == 1 else None)


def test_32_concurrent_streams_equal_requests_run_alone(server, reference_llm):
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                                timeout=120)

    async def one(i: int) -> tuple[str, str]:
        text, finish = "", None
        stream = await client.completions.create(model=MODEL, stream=True, **request(i))
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def everyone():
        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await client.close()

    results = asyncio.run(everyone())
    for i, (text, finish) in enumerate(results):
        r = request(i)
        alone = reference_llm.generate([r.pop("prompt")], SamplingParams(**r),
                                       use_tqdm=False)[0].outputs[0]
        assert text == alone.text, f"request {i}"
        assert finish == ("length" if alone.finish_reason == "length" else "stop"), i
    stats = wait_until_idle(server)
    assert stats["blocks_used"] == 0


def test_a_client_that_disconnects_is_aborted_and_its_blocks_freed(server):
    engine = server.app.state.engine
    metrics = server.app.state.metrics
    aborted_before = metrics.finished["abort"]._value.get()
    decoded_before = wait_until_idle(server)["decode_tokens"]

    def pace(*_):
        # A tiny-model step takes about a millisecond, and the engine thread holding the GIL
        # through back-to-back steps can starve the event loop that notices the hang-up: on
        # a loaded 2-core runner the 900 tokens were done first (twice in CI). 20 ms a step,
        # asleep without the GIL, bounds the race by steps: the disconnect must be seen
        # within 300 of them (6 s), as the last assertion says.
        time.sleep(0.02)

    engine.client.add_step_observer(pace)
    try:
        _disconnect_mid_stream(server, engine)
    finally:
        engine.client.step_observers.remove(pace)
    stats = wait_until_idle(server)
    assert stats["blocks_used"] == 0, stats
    wait_for(lambda: metrics.finished["abort"]._value.get() > aborted_before,
             "the abort of the request whose client left")
    assert metrics.finished["abort"]._value.get() == aborted_before + 1
    # it was stopped long before its 900 tokens: the engine decoded far fewer in all
    assert stats["decode_tokens"] - decoded_before < 300


def _disconnect_mid_stream(server, engine) -> None:
    """Start a 900-token stream, read three events, hang up; three short requests go on."""
    long = {"model": MODEL, "prompt": "The for statement is used to", "max_tokens": 900,
            "ignore_eos": True, "stream": True}
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/v1/completions", json=long) as r:
            got = []
            for line in r.iter_lines():  # read a few events, then hang up
                if line.startswith("data: {"):
                    got.append(json.loads(line[6:]))
                if len(got) == 3:
                    break
            assert engine.stats["blocks_used"] > 0  # the long request holds blocks
        # the connection is closed here, mid-stream; other requests go on
        others = [client.completions.create(model=MODEL, prompt="Return a list of the",
                                            max_tokens=8, temperature=0) for _ in range(3)]
    assert all(o.choices[0].text for o in others)
