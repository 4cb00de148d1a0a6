"""The OpenAI-compatible HTTP server: FastAPI in front of an AsyncLLMEngine.

    pagedllm serve                                   # the tiny model on http://127.0.0.1:8000
    pagedllm serve --model smollm2-135m-instruct     # a real chat model
    python -m pagedllm.serving --port 8001 --tier reference

Endpoints (OpenAI's shapes, so the official ``openai`` client works unchanged):

- ``POST /v1/completions`` and ``POST /v1/chat/completions``, with ``"stream": true`` as
  server-sent events ending in ``data: [DONE]``;
- ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus, ``pagedllm:`` names).

The path of one request: the handler parses and checks the body (a 400 naming the field, or a
413 for a body over the limit), turns it into SamplingParams and an engine prompt, and hands it
to the engine thread (``AsyncLLMEngine.add_request``), which refuses it (400) or queues it. Then
the response runs two tasks side by side: one reads the request's outputs as the steps produce
them and sends them (every step's new text as one event when streaming, or one JSON body at the
end), the other waits for the client to disconnect. Whichever ends first ends both, and the
request is aborted: the engine frees its blocks at the next step boundary. A request that runs
past ``--request-timeout`` is aborted the same way.
"""

import argparse
import asyncio
import hmac
import json
import logging
import socket
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pagedllm.reference.engine.chat import chat_prompt
from pagedllm.reference.engine.sampling_params import SamplingParams

from .args import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_REQUEST_TIMEOUT
from .async_engine import AsyncLLMEngine, EngineStepError
from .metrics import ServerMetrics
from .protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    new_id,
    now,
    parse_request,
    usage,
)

log = logging.getLogger("pagedllm.serving")

FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32

SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "seed", "max_tokens", "min_tokens",
                   "stop_token_ids", "stop", "logprobs", "ignore_eos")


# -- the app -----------------------------------------------------------------------------------
def build_app(llm, served_model_name: str = "pagedllm", *, api_key: str | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT) -> FastAPI:
    """The server around a loaded ``LLM`` of either tier. ``app.state.engine`` is the
    AsyncLLMEngine (started and stopped with the app), ``app.state.metrics`` its metrics."""
    metrics = ServerMetrics(served_model_name)
    engine = AsyncLLMEngine(llm, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="pagedllm", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine, app.state.metrics = engine, metrics
    server = _Handlers(engine, served_model_name, request_timeout)

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.get("/health")
    async def health():
        if not engine.is_running:
            raise APIError(500, "the engine thread has stopped")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": served_model_name, "object": "model", "created": now(),
            "owned_by": "pagedllm", "root": str(getattr(llm, "model_dir", served_model_name)),
            "max_model_len": engine.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.completions(await _read_json(request))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await server.chat(await _read_json(request))

    return _Gate(app, api_key, max_request_bytes)


class _BodyTooLarge(Exception):
    def __init__(self, limit: int):
        super().__init__(limit)
        self.limit = limit


class _Gate:
    """ASGI middleware in front of the app: the API key (401) and the body size limit (413).
    A body over the limit is refused from its Content-Length before it is read, or, when it
    comes in chunks without one, as soon as the bytes read pass the limit."""

    def __init__(self, app: FastAPI, api_key: str | None, max_request_bytes: int):
        self.app, self.api_key, self.limit = app, api_key, max_request_bytes
        self.state = app.state  # so that callers reach app.state through the gate

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", [])}
        if self.api_key is not None and scope["path"].startswith("/v1"):
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return await _send_json(send, 401, error_body(
                    401, "missing or wrong API key: send the header 'Authorization: Bearer "
                         "<key>' with the key given to --api-key"))
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.limit:
            return await _send_json(send, 413, _too_large(int(length), self.limit))
        seen = 0

        async def counted_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _BodyTooLarge(self.limit)
            return message

        return await self.app(scope, counted_receive, send)


def _too_large(size: int | None, limit: int) -> dict:
    what = f"{size} bytes" if size is not None else "more bytes"
    return error_body(413, f"the request body of {what} is over the limit of {limit} bytes "
                           "(--max-request-bytes)")


async def _send_json(send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


async def _read_json(request: Request):
    try:
        body = await request.body()
    except _BodyTooLarge as err:
        raise APIError(413, _too_large(None, err.limit)["error"]["message"]) from None
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as err:
        # ValueError: JSONDecodeError, UnicodeDecodeError, and an integer of more digits than
        # Python converts (4300); RecursionError: arrays or objects nested thousands deep.
        raise APIError(400, f"the request body is not valid JSON: {err}"[:300]) from None


# -- the handlers ------------------------------------------------------------------------------
class _Handlers:
    def __init__(self, engine: AsyncLLMEngine, model_name: str, timeout: float | None):
        self.engine, self.model_name, self.timeout = engine, model_name, timeout
        self.tokenizer = engine.tokenizer

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model `{model}` does not exist; this server serves "
                                f"`{self.model_name}` (GET /v1/models)", "model")

    def _params(self, req, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """OpenAI's fields -> SamplingParams, whose own checks name the field (400).

        The sampler holds temperature and top_p as float32 and top_k as int64: a temperature
        past float32's range would turn into inf (and a blocked token's -inf logit into NaN),
        so it is refused; a top_p below float32's smallest normal number would round to 0, so
        it becomes that number (either keeps only the most likely tokens); a top_k of the
        vocabulary or more keeps every token, so it becomes -1 (all tokens) before it can
        overflow int64 in a step and fail every request of that step."""
        if isinstance(req.temperature, float) and req.temperature > FLOAT32_MAX:
            raise APIError(400, f"temperature must be <= {FLOAT32_MAX:g} (float32's largest "
                                f"number), got {req.temperature:g}", "temperature")
        top_p = req.top_p
        if isinstance(top_p, float) and 0.0 < top_p < FLOAT32_TINY:
            top_p = FLOAT32_TINY
        top_k = req.top_k
        if top_k == 0 or top_k >= self.engine.engine.vocab_size:
            top_k = -1
        try:
            return SamplingParams(
                n=req.n, temperature=req.temperature, top_p=top_p, top_k=top_k, seed=req.seed,
                max_tokens=max_tokens if max_tokens is not None else self.engine.max_model_len,
                min_tokens=req.min_tokens, stop=req.stop, stop_token_ids=req.stop_token_ids,
                ignore_eos=req.ignore_eos, logprobs=logprobs)
        except (ValueError, TypeError) as err:
            raise APIError(400, str(err), _field_of(str(err))) from None

    async def _submit(self, prompts: list, params: SamplingParams, prompt_field: str,
                      base_id: str) -> tuple[list[str], asyncio.Queue]:
        """Add every prompt of the request; all their outputs arrive on one queue. A refused
        prompt refuses the whole request (the ones already added are aborted)."""
        outputs: asyncio.Queue = asyncio.Queue()
        ids: list[str] = []
        arrival = time.monotonic()
        try:
            for i, prompt in enumerate(prompts):
                request_id = f"{base_id}-{i}"
                await self.engine.add_request(request_id, prompt, params, arrival, outputs)
                ids.append(request_id)
        except RuntimeError as err:  # the engine thread is not running
            for request_id in ids:
                self.engine.abort(request_id)
            raise APIError(500, str(err)) from None
        except (ValueError, TypeError) as err:
            for request_id in ids:
                self.engine.abort(request_id)
            message = str(err)
            field = _field_of(message)
            if field is None and "prompt" in [w.strip(":,") for w in message.split(" ")[:3]]:
                field = prompt_field  # too long, empty, ids outside the vocabulary
            elif field is None and "could never finish" in message:
                field = "max_tokens"  # n x (prompt + max_tokens) is more than the KV pool
            raise APIError(400, message, field) from None
        except BaseException:
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        return ids, outputs

    # -- /v1/completions -----------------------------------------------------------------------
    async def completions(self, data) -> Response:
        req = parse_request(CompletionRequest, data)
        self._check_model(req.model)
        params = self._params(req, req.max_tokens, req.logprobs)
        prompt = req.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise APIError(400, "prompt is empty; give text or a list of token ids", "prompt")
        for p in prompts:
            if isinstance(p, str):
                _check_utf8(p, "prompt")
        prompts = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts]
        request_id = new_id("cmpl")
        ids, outputs = await self._submit(prompts, params, "prompt", request_id)
        run = _Run(self, ids, outputs, params, request_id, chat=False,
                   logprobs=req.logprobs, include_usage=bool(
                       req.stream_options and req.stream_options.include_usage))
        return EngineResponse(self.engine, run, stream=req.stream, timeout=self.timeout)

    # -- /v1/chat/completions ------------------------------------------------------------------
    async def chat(self, data) -> Response:
        req = parse_request(ChatCompletionRequest, data)
        self._check_model(req.model)
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise APIError(400, f"the model `{self.model_name}` has no chat template (it is not "
                                "a chat model): use /v1/completions with a plain prompt",
                           "messages")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        for i, message in enumerate(req.messages):
            _check_utf8(message.as_dict()["content"], f"messages[{i}].content")
        try:
            prompt = chat_prompt(self.tokenizer, [m.as_dict() for m in req.messages],
                                 add_generation_prompt=req.add_generation_prompt)
        except (ValueError, TypeError) as err:
            raise APIError(400, str(err), "messages") from None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        if max_tokens is None:  # as many as the context leaves
            max_tokens = max(1, self.engine.max_model_len - len(prompt["prompt_token_ids"]))
        params = self._params(req, max_tokens, logprobs)
        request_id = new_id("chatcmpl")
        ids, outputs = await self._submit([prompt], params, "messages", request_id)
        run = _Run(self, ids, outputs, params, request_id, chat=True, logprobs=logprobs,
                   include_usage=bool(req.stream_options and req.stream_options.include_usage))
        return EngineResponse(self.engine, run, stream=req.stream, timeout=self.timeout)


def _check_utf8(text: str, field: str) -> None:
    """JSON can spell a lone UTF-16 surrogate (\\ud800), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise APIError(400, f"{field} holds a character that is not valid Unicode (a lone "
                            f"surrogate, {text[err.start]!r}) at position {err.start}",
                       field) from None


def _field_of(message: str) -> str | None:
    """The request field an engine or SamplingParams message is about: its first word."""
    first = message.split(" ", 1)[0].rstrip(":,")
    return first if first in SAMPLING_FIELDS else None


# -- one request's outputs, as JSON or as events -----------------------------------------------
class _Run:
    """Reads the outputs of a request's engine requests and shapes them as OpenAI does."""

    def __init__(self, handlers: _Handlers, ids: list[str], outputs: asyncio.Queue,
                 params: SamplingParams, response_id: str, *, chat: bool,
                 logprobs: int | None, include_usage: bool):
        self.h, self.ids, self.outputs, self.params = handlers, ids, outputs, params
        self.id, self.chat, self.logprobs = response_id, chat, logprobs
        self.include_usage = include_usage
        self.created = now()
        self.unfinished = set(ids)
        # Streaming holds back the last len(longest stop string) - 1 characters: the engine
        # cuts a stop string out of the text when it completes, and what was already sent
        # cannot be taken back.
        self.holdback = max((len(s) for s in params.stop_strings), default=1) - 1
        self.sent_text: dict[int, int] = {}
        self.sent_tokens: dict[int, int] = {}
        self.final: dict[str, object] = {}

    async def outputs_until_done(self, deadline: float | None):
        """Every RequestOutput of this request's engine requests, as they come."""
        while self.unfinished:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError
            item = await asyncio.wait_for(self.outputs.get(), remaining)
            if isinstance(item, EngineStepError):
                raise item
            if item.finished:
                self.unfinished.discard(item.request_id)
                self.final[item.request_id] = item
            yield item

    def _index(self, out, completion) -> int:
        return self.ids.index(out.request_id) * self.params.n + completion.index

    def _usage(self, outs) -> dict:
        return usage(sum(len(o.prompt_token_ids) for o in outs),
                     sum(len(c.token_ids) for o in outs for c in o.outputs))

    # -- logprobs ---------------------------------------------------------------------------
    def _token(self, token_id: int) -> str:
        tok = self.h.tokenizer
        return tok.decode([token_id]) if tok is not None else str(token_id)

    def _logprobs(self, completion, start: int, text_offset: int = 0):
        if self.logprobs is None or completion.logprobs is None:
            return None
        entries = list(zip(completion.token_ids[start:], completion.logprobs[start:],
                           strict=True))
        k = self.logprobs
        if self.chat:
            return {"content": [{
                "token": self._token(t), "logprob": lps[t],
                "bytes": list(self._token(t).encode()),
                "top_logprobs": [{"token": self._token(i), "logprob": lp,
                                  "bytes": list(self._token(i).encode())}
                                 for i, lp in _top(lps, k)]} for t, lps in entries]}
        tokens = [self._token(t) for t, _ in entries]
        offsets, at = [], text_offset
        for piece in tokens:
            offsets.append(at)
            at += len(piece)
        return {"tokens": tokens, "token_logprobs": [lps[t] for t, lps in entries],
                "top_logprobs": [{self._token(i): lp for i, lp in _top(lps, k)}
                                 for _, lps in entries],
                "text_offset": offsets}

    # -- the whole answer at once -------------------------------------------------------------
    def body(self) -> dict:
        outs = [self.final[i] for i in self.ids]
        choices = []
        for out in outs:
            for c in out.outputs:
                choice = {"index": self._index(out, c), "logprobs": self._logprobs(c, 0),
                          "finish_reason": _finish_reason(c)}
                if self.chat:
                    choice["message"] = {"role": "assistant", "content": c.text}
                else:
                    choice["text"] = c.text
                choices.append(choice)
        choices.sort(key=lambda ch: ch["index"])
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.h.model_name, "choices": choices,
                "usage": self._usage(outs)}

    # -- server-sent events -------------------------------------------------------------------
    def _chunk(self, choices: list, **extra) -> bytes:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat
                else "text_completion", "created": self.created, "model": self.h.model_name,
                "choices": choices, **extra}
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    def first_events(self) -> list[bytes]:
        """Chat streams open with the assistant's role, one chunk per choice."""
        if not self.chat:
            return []
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])
                for i in range(len(self.ids) * self.params.n)]

    def events(self, out) -> list[bytes]:
        """The chunks one RequestOutput adds: each completion's new text (and tokens)."""
        chunks = []
        for c in out.outputs:
            index = self._index(out, c)
            sent, sent_tokens = self.sent_text.get(index, 0), self.sent_tokens.get(index, 0)
            done = c.finish_reason is not None
            end = len(c.text) if done else max(sent, len(c.text) - self.holdback)
            delta = c.text[sent:end]
            new_tokens = len(c.token_ids) > sent_tokens
            if not delta and not done and not (new_tokens and self.logprobs is not None):
                continue
            if done and index in self.sent_text and self.sent_text[index] < 0:
                continue  # its last chunk went out already
            logprobs = self._logprobs(c, sent_tokens, sent) if new_tokens else None
            self.sent_text[index] = -1 if done else end
            self.sent_tokens[index] = len(c.token_ids)
            choice = {"index": index, "logprobs": logprobs,
                      "finish_reason": _finish_reason(c) if done else None}
            if self.chat:
                choice["delta"] = {"content": delta} if delta or not done else {}
            else:
                choice["text"] = delta
            chunks.append(self._chunk([choice]))
        return chunks

    def last_events(self) -> list[bytes]:
        if not self.include_usage:
            return []
        return [self._chunk([], usage=self._usage([self.final[i] for i in self.ids]))]


def _top(lps: dict, k: int) -> list:
    return sorted(lps.items(), key=lambda item: -item[1])[:k]


def _finish_reason(completion) -> str | None:
    reason = completion.finish_reason
    return "length" if reason == "length" else ("stop" if reason is not None else None)


class EngineResponse(Response):
    """An ASGI response that runs the request while watching the connection.

    Two tasks: ``produce`` reads the outputs and sends them; ``watch`` waits for the client's
    disconnect. When either ends, the other is cancelled, and every engine request of this
    HTTP request is aborted (a no-op for those that finished): a client that hangs up mid-stream
    frees its KV blocks at the next step, not when its answer would have been complete.
    """

    def __init__(self, engine: AsyncLLMEngine, run: _Run, stream: bool, timeout: float | None):
        # Response's own attributes are not used: the status and the body are sent below.
        self.engine, self.run, self.stream, self.timeout = engine, run, stream, timeout
        self.background = None
        self.status: int | None = None

    # --8<-- [start:response]
    async def __call__(self, scope, receive, send):
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        produce = asyncio.ensure_future(self._produce(send, deadline))
        watch = asyncio.ensure_future(_until_disconnect(receive))
        try:
            await asyncio.wait({produce, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (produce, watch):
                task.cancel()
            await asyncio.gather(produce, watch, return_exceptions=True)
            for request_id in self.run.ids:
                if request_id in self.run.unfinished:
                    self.engine.abort(request_id)
        if produce.done() and not produce.cancelled() and produce.exception() is not None:
            if not isinstance(produce.exception(), OSError):  # OSError: the client is gone
                raise produce.exception()
    # --8<-- [end:response]

    async def _produce(self, send, deadline: float | None) -> None:
        run = self.run
        if not self.stream:
            status, body = 200, None
            try:
                async for _ in run.outputs_until_done(deadline):
                    pass
                body = run.body()
            except TimeoutError:
                status, body = 408, error_body(408, f"the request ran past the time limit of "
                                                    f"{self.timeout:g} s (--request-timeout)")
            except EngineStepError as err:
                status, body = 500, error_body(500, str(err))
            self.status = status
            await _send_json(send, status, body)
            return
        self.status = 200
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                (b"cache-control", b"no-cache")]})

        async def emit(chunks: list[bytes]) -> None:
            if chunks:
                await send({"type": "http.response.body", "body": b"".join(chunks),
                            "more_body": True})

        await emit(run.first_events())
        try:
            async for out in run.outputs_until_done(deadline):
                await emit(run.events(out))
            await emit(run.last_events())
        except TimeoutError:
            await emit([b"data: " + json.dumps(error_body(
                408, f"the request ran past the time limit of {self.timeout:g} s "
                     "(--request-timeout)")).encode() + b"\n\n"])
        except EngineStepError as err:
            await emit([b"data: " + json.dumps(error_body(500, str(err))).encode() + b"\n\n"])
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n",
                    "more_body": False})


async def _until_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


# -- loading and running -----------------------------------------------------------------------
def load_llm(args: argparse.Namespace):
    """The LLM of the chosen tier, configured from the flags."""
    import torch

    from pagedllm.reference.kv_size import kv_size
    from pagedllm.reference.model import resolve_model

    from .default_model import default_model_dir

    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    model = args.model or args.model_tag
    dtype = "float32" if args.dtype == "auto" else args.dtype
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" \
        else args.device
    folder = Path(resolve_model(model, dtype)) if model else default_model_dir()
    if args.tier == "reference" and (args.gpu_memory_utilization is not None
                                     or args.enforce_eager):
        raise ValueError("--gpu-memory-utilization and --enforce-eager are options of the "
                         "optimized tier (--tier optimized)")
    if args.swap_space < 0:
        raise ValueError(f"--swap-space must be >= 0 GiB, got {args.swap_space}")
    if args.preemption_mode == "swap" and args.swap_space == 0:
        raise ValueError("--preemption-mode swap moves blocks to CPU memory: give it some with "
                         "--swap-space GIB (e.g. --swap-space 1)")
    block_bytes = kv_size(folder, dtype).bytes_per_token * args.block_size
    kwargs = dict(dtype=dtype, device=device, block_size=args.block_size,
                  num_gpu_blocks=args.num_gpu_blocks_override,
                  kv_cache_memory=args.kv_cache_memory_bytes,
                  swap_space_blocks=int(args.swap_space * 2**30) // block_bytes,
                  max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  max_model_len=args.max_model_len, preemption_mode=args.preemption_mode,
                  enable_prefix_caching=args.enable_prefix_caching,
                  enable_chunked_prefill=args.enable_chunked_prefill, seed=args.seed)
    if args.tier == "optimized":
        from pagedllm.optimized import LLM

        if args.gpu_memory_utilization is not None:
            kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
        return LLM(folder, enforce_eager=args.enforce_eager, **kwargs)
    from pagedllm.reference.engine.llm import LLM

    return LLM(folder, **kwargs)


def served_name(args: argparse.Namespace) -> str:
    return args.served_model_name or args.model or args.model_tag or "tiny-pydoc"


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.request_timeout < 0:
        raise ValueError(f"--request-timeout must be >= 0 seconds, got {args.request_timeout}")
    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    llm = load_llm(args)
    name = served_name(args)
    app = build_app(llm, name, api_key=args.api_key, max_request_bytes=args.max_request_bytes,
                    request_timeout=args.request_timeout or None)
    sock = bind(args.host, args.port)  # bound before the banner, so the port is known
    host, port = sock.getsockname()[:2]
    stats = llm.stats()
    print(f"pagedllm: serving {name} ({args.tier} tier, {stats['blocks_total']} KV blocks of "
          f"{args.block_size} tokens, max_model_len {app.state.engine.max_model_len}) on "
          f"http://{host}:{port}/v1", flush=True)
    config = uvicorn.Config(app, log_level=args.uvicorn_log_level, timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise OSError(f"cannot bind {host}:{port}: {err.strerror}") from None
    return sock


class ServerThread:
    """Run an app on loopback in a background thread (tests, notebooks)::

        with ServerThread(build_app(llm)) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.sock = bind(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()
