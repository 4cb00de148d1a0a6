"""The OpenAI-compatible HTTP server: the FastAPI app and its routes, in front of an
AsyncLLMEngine (or the data-parallel router over one per replica).

    pagedllm serve                                   # the tiny model on http://127.0.0.1:8000
    pagedllm serve --model smollm2-135m-instruct     # a real chat model
    python -m pagedllm.serving --port 8001 --tier reference

Endpoints (OpenAI's shapes, so the official ``openai`` client works unchanged):

- ``POST /v1/completions`` and ``POST /v1/chat/completions``, with ``"stream": true`` as
  server-sent events ending in ``data: [DONE]``;
- ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus, ``pagedllm:`` names);
- ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info`` (vLLM's shapes:
  ``tokenization``);
- ``POST /generate``: the body and answer of vLLM's demo server
  (``python -m vllm.entrypoints.api_server``; ``demo_api``), for the scripts written for it.

Each request is logged at INFO (its id, prompt length and sampling parameters) unless the
server was started with ``--disable-log-requests``, as vLLM logs them.

The path of one request, one module per job. The gate (``gate``) refuses a missing API key
(401) or a body over the limit (413) before any route runs. The route reads the body and maps
it (``request_mapping``: a 400 naming the field; a structured output's grammar is built on a
worker thread, never on the event loop) to SamplingParams and engine prompts, and hands them to
the engine thread (``AsyncLLMEngine.add_request``), which refuses them (400) or queues them.
Then the response (``responses``) runs two tasks side by side: one reads the request's
outputs as the steps produce them and sends them (every step's new text as one event when
streaming, or one JSON body at the end), the other waits for the client to disconnect.
Whichever ends first ends both, and the request is aborted: the engine frees its blocks at the
next step boundary. A request that runs past ``--request-timeout`` is aborted the same way.
Loading the model, building the engine the app serves and running uvicorn are ``launch``'s;
this module imports none of that, so the app can be built around any engine.
"""

import asyncio
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pagedllm.reference.engine.sampling_params import SamplingParams

from .args import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_REQUEST_TIMEOUT
from .async_engine import ServingEngine
from .demo_api import DemoRun, demo_request
from .gate import Gate, read_json
from .loader import load_llm
from .protocol import APIError, new_id, now
from .request_mapping import EngineRequest, RequestMapper, refusal
from .responses import EngineResponse, RequestRun
from .server_thread import ServerThread
from .tokenization import Tokenization

# ServerThread and load_llm live in modules of their own (a replica loads without the app);
# the tests and notebooks that import them from here keep working.
__all__ = ["build_app", "EngineResponse", "ServerThread", "load_llm"]

logger = logging.getLogger("pagedllm.serving")


def build_app(engine: ServingEngine, served_model_name: str = "pagedllm", *,
              root: str | None = None, api_key: str | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT,
              log_requests: bool = False) -> Gate:
    """The server around ``engine``: an ``AsyncLLMEngine`` over an engine client, or the
    ``DataParallelEngine`` routing to one per replica, built with the server's
    ``ServerMetrics``; the app starts and stops it. ``app.state.engine`` is it,
    ``app.state.metrics`` its (engine 0's) metrics. ``root``: the model's folder, as
    ``/v1/models`` reports it (the served name if not given). ``log_requests``: each
    request's id, prompt length and sampling parameters at INFO on the ``pagedllm.serving``
    logger (``pagedllm serve`` turns it on unless ``--disable-log-requests``)."""
    metrics = engine.metrics
    if metrics is None:
        raise ValueError("build_app serves /metrics: build the engine with a ServerMetrics, "
                         "e.g. AsyncLLMEngine(llm.engine, ServerMetrics(served_model_name))")
    mapper = RequestMapper(served_model_name, engine.tokenizer, engine.limits)
    tokenization = Tokenization(served_model_name, engine.tokenizer, engine.limits)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="pagedllm", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine, app.state.metrics = engine, metrics

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.get("/health")
    async def health():
        if not engine.is_running:
            raise APIError(500, "the engine thread has stopped")
        try:
            engine.check_health()  # a tensor-parallel engine's ranks, a replica's process
        except Exception as err:  # noqa: BLE001 - any failure: not healthy, and why
            raise APIError(503, str(err)) from None
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": served_model_name, "object": "model", "created": now(),
            "owned_by": "pagedllm", "root": root or served_model_name,
            "max_model_len": engine.limits.max_model_len}]}

    async def answer(req: EngineRequest) -> EngineResponse:
        response_id = new_id("chatcmpl" if req.chat else "cmpl")
        ids, outputs = await _submit(engine, req.prompts, req.params, req.prompt_field,
                                     response_id, log_requests)
        run = RequestRun(ids, outputs, req.params, response_id, served_model_name,
                         engine.tokenizer, chat=req.chat, logprobs=req.logprobs,
                         include_usage=req.include_usage, echo=req.echo,
                         generates=req.generates, prompt_logprobs=req.prompt_logprobs,
                         structured_field=req.structured_field)
        return EngineResponse(engine, run, stream=req.stream, timeout=request_timeout)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(await mapper.completion(await read_json(request)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(await mapper.chat(await read_json(request)))

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return tokenization.tokenize(await read_json(request))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return tokenization.detokenize(await read_json(request))

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return tokenization.tokenizer_info()

    @app.post("/generate")
    async def generate(request: Request):
        """vLLM's demo server: {"prompt", "stream", sampling fields} -> {"text": [prompt +
        completion, ...]}; a stream sends that object, the text so far, after every step."""
        req = demo_request(await read_json(request))
        response_id = new_id("generate")
        ids, outputs = await _submit(engine, req.prompts, req.params, "prompt", response_id,
                                     log_requests)
        run = DemoRun(ids, outputs, req.params, response_id, served_model_name,
                      engine.tokenizer, chat=False, logprobs=None, include_usage=False)
        return EngineResponse(engine, run, stream=req.stream, timeout=request_timeout)

    return Gate(app, api_key, max_request_bytes)


async def _submit(engine: ServingEngine, prompts: list, params: SamplingParams,
                  prompt_field: str, base_id: str,
                  log_requests: bool = False) -> tuple[list[str], asyncio.Queue]:
    """Add every prompt of the request; all their outputs arrive on one queue. A refused
    prompt refuses the whole request (the ones already added are aborted)."""
    outputs: asyncio.Queue = asyncio.Queue()
    ids: list[str] = []
    arrival = time.monotonic()
    try:
        for i, prompt in enumerate(prompts):
            request_id = f"{base_id}-{i}"
            if log_requests:
                logger.info("Received request %s: prompt length %s, params: %s", request_id,
                            _prompt_length(engine, prompt), params)
            await engine.add_request(request_id, prompt, params, arrival, outputs)
            ids.append(request_id)
    except RuntimeError as err:  # the engine thread is not running
        for request_id in ids:
            engine.abort(request_id)
        raise APIError(500, str(err)) from None
    except (ValueError, TypeError) as err:  # the engine refused it: too long, never fits, ...
        for request_id in ids:
            engine.abort(request_id)
        raise refusal(err, prompt_field) from None
    except BaseException:
        for request_id in ids:
            engine.abort(request_id)
        raise
    return ids, outputs


def _prompt_length(engine: ServingEngine, prompt) -> str:
    """A prompt's length for the request log: its token count (as the engine will count
    it), or its characters where no tokenizer is at hand."""
    if isinstance(prompt, dict):
        return f"{len(prompt['prompt_token_ids'])} tokens"
    if engine.tokenizer is None:
        return f"{len(prompt)} characters"
    return f"{len(engine.tokenizer(prompt)['input_ids'])} tokens"
