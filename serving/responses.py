"""Response shaping and streaming: one HTTP request's engine outputs, sent as OpenAI sends them.

``RequestRun`` reads the outputs of the request's engine requests and shapes them: one JSON body
at the end (``body``), or server-sent events as the steps produce them (``first_events``,
``events``, ``last_events``), with logprobs and usage in OpenAI's shapes. A completion with
``echo`` starts with its prompt: the prompt's text before the completion's, and with logprobs
the prompt's tokens before the completion's in OpenAI's legacy layout (the first token's
logprob None: nothing predicts it), as vLLM answers; with ``max_tokens: 0`` the prompt alone.
vLLM's ``prompt_logprobs: k`` adds its own layout, on each completion choice (on the chat
answer itself): per prompt token None (the first) or ``{"id": {"logprob", "rank",
"decoded_token"}}`` for the token and the k most likely.
A completion the engine ended with finish_reason "error" (its grammar allowed no token) ends
the answer as an error naming the request's structured-output field: a 400, or a stream's last
event; the text the grammar refused is never answered as "stop".
``EngineResponse`` is the ASGI response that sends them while it watches the connection: a
client that hangs up, or a request past its time limit, is aborted in the engine.
"""

import asyncio
import json
import time

from fastapi.responses import Response

from pagedllm.reference.engine.sampling_params import SamplingParams

from .async_engine import EngineStepError, ServingEngine
from .protocol import APIError, error_body, now, usage


class RequestRun:
    """Reads the outputs of a request's engine requests and shapes them as OpenAI does."""

    STREAM_TYPE = b"text/event-stream; charset=utf-8"  # a stream's content type
    STREAM_END = b"data: [DONE]\n\n"  # and its last bytes

    def __init__(self, ids: list[str], outputs: asyncio.Queue, params: SamplingParams,
                 response_id: str, model_name: str, tokenizer, *, chat: bool,
                 logprobs: int | None, include_usage: bool, echo: bool = False,
                 generates: bool = True, prompt_logprobs: int | None = None,
                 structured_field: str | None = None):
        self.ids, self.outputs, self.params = ids, outputs, params
        self.structured_field = structured_field  # the request's name for its grammar
        self.echo, self.generates, self.prompt_k = echo, generates, prompt_logprobs
        self.echoed: set[int] = set()  # streams: the choices whose prompt was sent
        self.id, self.model_name, self.tokenizer = response_id, model_name, tokenizer
        self.chat, self.logprobs, self.include_usage = chat, logprobs, include_usage
        self.created = now()
        self.unfinished = set(ids)
        # Streaming holds back the last len(longest stop string) - 1 characters: the engine
        # cuts a stop string out of the text when it completes, and what was already sent
        # cannot be taken back.
        self.holdback = max((len(s) for s in params.stop_strings), default=1) - 1
        self.sent_text: dict[int, int] = {}
        self.sent_tokens: dict[int, int] = {}
        # the text_offset of each choice's next token: the tokens' own text, as the whole
        # answer counts it, not the characters sent (the holdback keeps those behind)
        self.next_offset: dict[int, int] = {}
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
            failed = next((c for c in item.outputs if c.finish_reason == "error"), None)
            if failed is not None:
                raise self._unsatisfied(failed)
            yield item

    def _unsatisfied(self, completion) -> APIError:
        """A completion the engine ended with finish_reason "error": its grammar allowed no
        token (a dead end, or nothing of this vocabulary at the start). The constraint is the
        request's, so a 400 naming its field; never "stop" for text the grammar refused."""
        if self.structured_field is None:  # no grammar: nothing else ends a request so
            return APIError(500, "the engine ended the request with an error")
        return APIError(400, f"{self.structured_field} cannot be satisfied: no token of the "
                             f"model's vocabulary may follow the output so far "
                             f"({completion.text!r:.80})", self.structured_field)

    def _index(self, out, completion) -> int:
        return self.ids.index(out.request_id) * self.params.n + completion.index

    def _usage(self, outs) -> dict:
        generated = sum(len(c.token_ids) for o in outs for c in o.outputs)
        return usage(sum(len(o.prompt_token_ids) for o in outs),
                     generated if self.generates else 0)  # max_tokens 0: none kept

    # -- logprobs ---------------------------------------------------------------------------
    def _token(self, token_id: int) -> str:
        tok = self.tokenizer
        return tok.decode([token_id]) if tok is not None else str(token_id)

    def _prompt_text(self, out) -> str:
        """What echo sends of the prompt: its text, or its token ids decoded (special
        tokens kept, as vLLM does)."""
        if out.prompt is not None:
            return out.prompt
        tok = self.tokenizer
        return tok.decode(out.prompt_token_ids) if tok is not None else ""

    def _echo(self, out) -> tuple[str, list]:
        """The prompt's text and its (token, logprobs) entries, the first (None) included."""
        entries = list(zip(out.prompt_token_ids, out.prompt_logprobs or [], strict=False))
        return self._prompt_text(out), entries

    def _prompt_logprobs(self, out) -> list:
        """vLLM's prompt_logprobs: per prompt token None (the first) or {id: {logprob, rank,
        decoded_token}} for the token itself and the k most likely (ranks 1..k)."""
        answer = [None]
        for token, lps, rank in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:],
                                    out.prompt_token_ranks[1:], strict=True):
            entry = {str(token): {"logprob": lps[token], "rank": rank,
                                  "decoded_token": self._token(token)}}
            for i, (t, lp) in enumerate(_top(lps, self.prompt_k), start=1):
                entry.setdefault(str(t), {"logprob": lp, "rank": i,
                                          "decoded_token": self._token(t)})
            answer.append(entry)
        return answer

    def _logprobs(self, completion, start: int, text_offset: int = 0, before=()):
        """The completion's token logprobs from token `start` on, after the entries
        `before` (echo's prompt entries; an entry's logprobs None: the first token)."""
        if self.logprobs is None or completion.logprobs is None:
            return None
        entries = list(before)
        if self.generates:
            entries += zip(completion.token_ids[start:], completion.logprobs[start:],
                           strict=True)
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
        return {"tokens": tokens,
                "token_logprobs": [None if lps is None else lps[t] for t, lps in entries],
                "top_logprobs": [None if lps is None else
                                 {self._token(i): lp for i, lp in _top(lps, k)}
                                 for _, lps in entries],
                "text_offset": offsets}

    # -- the whole answer at once -------------------------------------------------------------
    def body(self) -> dict:
        outs = [self.final[i] for i in self.ids]
        choices = []
        for out in outs:
            for c in out.outputs:
                prompt, before = self._echo(out) if self.echo else ("", [])
                text = prompt + c.text if self.generates else prompt
                choice = {"index": self._index(out, c),
                          "logprobs": self._logprobs(c, 0, before=before),
                          "finish_reason": _finish_reason(c) if self.generates else "length"}
                if self.chat:
                    choice["message"] = {"role": "assistant", "content": c.text}
                else:
                    choice["text"] = text
                    if self.prompt_k is not None:
                        choice["prompt_logprobs"] = self._prompt_logprobs(out)
                choices.append(choice)
        choices.sort(key=lambda ch: ch["index"])
        body = {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model_name, "choices": choices,
                "usage": self._usage(outs)}
        if self.chat and self.prompt_k is not None:  # vLLM: on the answer, one prompt
            body["prompt_logprobs"] = self._prompt_logprobs(outs[0])
        return body

    # -- server-sent events -------------------------------------------------------------------
    def _chunk(self, choices: list, **extra) -> bytes:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat
                else "text_completion", "created": self.created, "model": self.model_name,
                "choices": choices, **extra}
        return _event(body)

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
            if not self.generates:  # max_tokens 0: the prompt alone, once it is scored
                if done and index not in self.echoed:
                    prompt, before = self._echo(out)
                    self.echoed.add(index)
                    chunks.append(self._chunk([{
                        "index": index, "text": prompt, "finish_reason": "length",
                        "logprobs": self._logprobs(c, 0, before=before)}]))
                continue
            prompt, before = "", []
            echo_now = self.echo and index not in self.echoed and bool(c.token_ids or done)
            if echo_now:  # the prefill is done: the prompt goes out first
                prompt, before = self._echo(out)
                self.echoed.add(index)
            end = len(c.text) if done else max(sent, len(c.text) - self.holdback)
            delta = c.text[sent:end]
            new_tokens = len(c.token_ids) > sent_tokens
            if not (delta or echo_now or done or (new_tokens and self.logprobs is not None)):
                continue
            if done and index in self.sent_text and self.sent_text[index] < 0:
                continue  # its last chunk went out already
            # text offsets count the echoed prompt's tokens, sent in this choice's first chunk
            offset = 0 if echo_now else self.next_offset.get(index, 0)
            logprobs = (self._logprobs(c, sent_tokens, offset, before=before)
                        if new_tokens or echo_now else None)
            if logprobs is not None and logprobs.get("tokens"):  # chat's have no offsets
                self.next_offset[index] = (logprobs["text_offset"][-1]
                                           + len(logprobs["tokens"][-1]))
            self.sent_text[index] = -1 if done else end
            self.sent_tokens[index] = len(c.token_ids)
            choice = {"index": index, "logprobs": logprobs,
                      "finish_reason": _finish_reason(c) if done else None}
            if self.chat:
                choice["delta"] = {"content": delta} if delta or not done else {}
            else:
                choice["text"] = prompt + delta
            chunks.append(self._chunk([choice]))
        return chunks

    def error_event(self, body: dict) -> bytes:
        """An error after the stream's 200 went out: its last event."""
        return _event(body)

    def last_events(self) -> list[bytes]:
        if not self.include_usage:
            return []
        return [self._chunk([], usage=self._usage([self.final[i] for i in self.ids]))]


def _top(lps: dict, k: int) -> list:
    return sorted(lps.items(), key=lambda item: -item[1])[:k]


def _finish_reason(completion) -> str | None:
    reason = completion.finish_reason
    return "length" if reason == "length" else ("stop" if reason is not None else None)


def _event(body: dict) -> bytes:
    """One server-sent event: a ``data:`` line and the blank line that ends it."""
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def send_json(send, status: int, body: dict) -> None:
    """A whole JSON response, straight to ASGI (the gate answers before any route runs)."""
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


class EngineResponse(Response):
    """An ASGI response that runs the request while watching the connection.

    Two tasks: ``produce`` reads the outputs and sends them; ``watch`` waits for the client's
    disconnect. When either ends, the other is cancelled, and every engine request of this
    HTTP request is aborted (a no-op for those that finished): a client that hangs up mid-stream
    frees its KV blocks at the next step, not when its answer would have been complete.
    """

    def __init__(self, engine: ServingEngine, run: RequestRun, stream: bool,
                 timeout: float | None):
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

    def _timed_out(self) -> dict:
        return error_body(408, f"the request ran past the time limit of {self.timeout:g} s "
                               "(--request-timeout)")

    async def _produce(self, send, deadline: float | None) -> None:
        run = self.run
        if not self.stream:
            status, body = 200, None
            try:
                async for _ in run.outputs_until_done(deadline):
                    pass
                body = run.body()
            except TimeoutError:
                status, body = 408, self._timed_out()
            except EngineStepError as err:
                status, body = 500, error_body(500, str(err))
            except APIError as err:  # a constraint nothing satisfies
                status, body = err.status, err.body()
            self.status = status
            await send_json(send, status, body)
            return
        self.status = 200
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", run.STREAM_TYPE),
                                (b"cache-control", b"no-cache")]})

        async def emit(chunks: list[bytes]) -> None:
            if chunks:
                await send({"type": "http.response.body", "body": b"".join(chunks),
                            "more_body": True})

        await emit(run.first_events())
        # A stream has sent its 200 already: an error is its last event, before [DONE].
        try:
            async for out in run.outputs_until_done(deadline):
                await emit(run.events(out))
            await emit(run.last_events())
        except TimeoutError:
            await emit([run.error_event(self._timed_out())])
        except EngineStepError as err:
            await emit([run.error_event(error_body(500, str(err)))])
        except APIError as err:
            await emit([run.error_event(err.body())])
        await send({"type": "http.response.body", "body": run.STREAM_END,
                    "more_body": False})


async def _until_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
