"""AsyncLLMEngine: the engine behind a server. One thread steps it; asyncio streams the results.

``LLMEngine.step()`` is CPU-bound (or waits on the GPU): run on the event loop it would freeze
every connection for the length of a step. So one dedicated thread, the *engine thread*, owns
the engine and is the only code that ever touches it. The event loop talks to it through a
queue of commands (``messages``), and it talks back through each request's ``asyncio.Queue``::

    event loop (HTTP handlers)                          engine thread
    --------------------------                          -------------
    add_request(id, prompt, params) -- SubmitRequest -->  between steps: engine.add_request;
       awaits acceptance (or the ValueError)  <---------  the answer, via call_soon_threadsafe
    async for out in stream         <-- RequestOutput --  engine.step(), every step
    abort(id) (client gone, timeout) -- AbortRequest -->  between steps: engine.abort_request
                                                          (its blocks free for the next step)

What the thread steps is an ``EngineClient`` (``reference/engine/client.py``), and only its
methods are used: an in-process ``LLMEngine`` of either tier, or a data-parallel replica's proxy
whose calls cross a pipe (``data_parallel.ReplicaClient``), run the same way.

Commands are applied only between steps, so a step never sees the request set change under
it, and no lock is needed: the engine is single-threaded, as it was written to be. While no
request is unfinished the thread sleeps on an Event instead of spinning.

The thread never dies of an error: a failed step ends the step's requests with an error (the
engine freed them); a failure anywhere else in the loop (the bookkeeping around the step) ends
every live request with an error and frees its blocks, and the loop goes on. A failure of the
metrics alone is logged and ends nothing. Should the thread end anyway (shutdown), every live
request and every queued add is answered, so no caller waits forever.

The engine thread also keeps the metrics: after every step it reads ``engine.stats()`` into the
gauges and times each request's first token, the gaps between its tokens and its end.
"""

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from pagedllm.reference.engine.client import EngineClient, ModelLimits
from pagedllm.reference.engine.outputs import RequestOutput

from .messages import AbortRequest, AddRequest, SubmitRequest
from .metrics import ServerMetrics

log = logging.getLogger("pagedllm.serving")


class EngineStepError(RuntimeError):
    """A step failed while this request was in it; the engine freed the request and goes on."""


@dataclass
class _Tracked:
    """What the engine thread knows of one live request (engine thread only)."""

    outputs: asyncio.Queue  # the request's stream's queue (the event loop reads it)
    arrival: float
    prompt_len: int = 0
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0


@dataclass
class RequestStream:
    """The outputs of one request, in order; the last one has ``finished`` set."""

    request_id: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item


class ServingEngine(Protocol):
    """What the HTTP server asks of its engine: an ``AsyncLLMEngine``, or the data-parallel
    router (``data_parallel.DataParallelEngine``) over one per replica. The routes use only
    these names, so they serve either unchanged."""

    tokenizer: object  # the model's tokenizer, or None
    limits: ModelLimits  # what a request is checked against before it is sent
    metrics: ServerMetrics | None  # the server's metrics (engine 0's with replicas)
    stats: dict  # the last stats() snapshot
    steps: int  # engine steps run so far

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None: ...

    def shutdown(self, timeout: float = 30.0) -> None: ...

    @property
    def is_running(self) -> bool: ...

    def check_health(self) -> None: ...

    async def add_request(self, request_id: str, prompt, params, arrival: float | None = None,
                          queue: asyncio.Queue | None = None) -> RequestStream: ...

    def abort(self, request_id: str) -> None: ...


class AsyncLLMEngine:
    """Serve one ``EngineClient`` to many concurrent asyncio callers."""

    def __init__(self, client: EngineClient, metrics: ServerMetrics | None = None):
        self.client, self.metrics = client, metrics
        self.tokenizer, self.limits = client.tokenizer, client.limits
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._live: dict[str, _Tracked] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._closed = False  # set when the thread ends: add_request answers by itself
        self.stats: dict = client.stats()  # a snapshot, replaced after every step
        self.steps = 0

    # -- the event loop's side -------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort what is left and stop the thread (after the step in progress). The client
        stays up: whoever made it shuts it down (its ranks, its replica process)."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_unfinished(self) -> int:
        """Requests taken and not yet finished (read from the event loop: a len is atomic)."""
        return len(self._live)

    def check_health(self) -> None:
        """Raise if the engine cannot step (a tensor-parallel rank, a replica has died)."""
        self.client.check_health()

    async def add_request(self, request_id: str, prompt, params, arrival: float | None = None,
                          queue: asyncio.Queue | None = None) -> RequestStream:
        """Queue a request; returns its stream once the engine took it. A request the engine
        refuses raises its ValueError / TypeError here, before anything is streamed. Several
        requests may share one ``queue`` (a prompt list, or an HTTP request's n prompts): their
        outputs then arrive on it interleaved, each tagged with its request_id."""
        if not self.is_running:
            raise RuntimeError("the engine thread is not running")
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, queue if queue is not None else asyncio.Queue())
        accepted = loop.create_future()
        self._send(SubmitRequest(AddRequest(request_id, prompt, params), stream.queue, accepted,
                                 arrival if arrival is not None else time.monotonic()))
        if self._closed:  # the thread ended after the check above: nobody else will answer
            self._drain_commands()
        try:
            await accepted
        except asyncio.CancelledError:  # the caller went away before the engine answered
            self.abort(request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Remove a request at the next step boundary (a no-op if it already finished)."""
        self._send(AbortRequest(request_id))

    def _send(self, command: SubmitRequest | AbortRequest) -> None:
        self._commands.put(command)
        self._wake.set()

    # -- the engine thread -----------------------------------------------------------------------
    # --8<-- [start:run]
    def _run(self) -> None:
        try:
            while True:
                if not self.client.has_unfinished_requests():
                    self._wake.wait()
                self._wake.clear()
                try:
                    self._apply_commands()
                    if self._stopping:
                        self._fail_live(RuntimeError("the server is shutting down"),
                                        "abort")
                        return
                    if self.client.has_unfinished_requests():
                        self._step()
                except Exception as err:  # noqa: BLE001
                    # bookkeeping failed: end the live requests rather than hang
                    log.exception("the engine thread failed outside a step; its live "
                                  "requests end with an error")
                    self._fail_live(err, "error")
                    self._wake.set()  # commands may be left in the queue: look again
        finally:
            self._closed = True
            self._fail_live(RuntimeError("the engine thread stopped"), "abort")
            self._drain_commands()
    # --8<-- [end:run]

    def _fail_live(self, err: BaseException, reason: str) -> None:
        """End every live request: out of the engine (its blocks freed), an error to its
        stream."""
        for request_id in list(self._live):
            tracked = self._live.pop(request_id)
            try:
                if self.client.has_request(request_id):
                    self.client.abort_request(request_id)
            except Exception:  # noqa: BLE001 - the others must still be ended
                log.exception("could not abort %s", request_id)
            if self.metrics is not None:
                self.metrics.finished[reason].inc()
            self._call(tracked.outputs.put_nowait,
                       EngineStepError(f"the request could not finish: {err}"))
        self._snapshot()

    def _queued_commands(self):
        """The commands queued so far, oldest first, taken off the queue one by one."""
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _drain_commands(self) -> None:
        """The thread is gone: refuse every queued add (nothing else needs an answer)."""
        for command in self._queued_commands():
            if isinstance(command, SubmitRequest):
                self._call(_settle, command.accepted,
                           RuntimeError("the engine thread is not running"))

    def _apply_commands(self) -> None:
        for command in self._queued_commands():
            match command:
                case SubmitRequest():
                    self._add(command)
                case AbortRequest(request_id=request_id):
                    self._abort(request_id)
                case _:
                    raise TypeError(f"unknown engine-thread command {command!r}")
        # the snapshot is refreshed by the next step, or here when no step follows

    def _add(self, command: SubmitRequest) -> None:
        request = command.request
        try:
            self.client.add_request(request.request_id, request.prompt, request.params)
        except Exception as err:  # noqa: BLE001 - a refused request: the caller gets the error
            self._call(_settle, command.accepted, err)
            return
        self._live[request.request_id] = _Tracked(command.outputs, command.arrival)
        self._call(_settle, command.accepted, None)
        if not self.client.has_unfinished_requests():
            self._snapshot()

    def _abort(self, request_id: str) -> None:
        tracked = self._live.pop(request_id, None)
        try:
            # Finished meanwhile (or refused): the engine no longer holds it, nothing to free.
            if self.client.has_request(request_id):
                self.client.abort_request(request_id)  # its blocks go back to the pool now
        except Exception:  # noqa: BLE001 - the engine runs it to its end and frees it then
            log.exception("could not abort %s", request_id)
        if tracked is not None and self.metrics is not None:
            self.metrics.finished["abort"].inc()
        self._snapshot()

    def _step(self) -> None:
        try:
            outputs = self.client.step()
        except Exception as err:  # noqa: BLE001 - the engine freed the step's requests
            log.exception("an engine step failed; its requests end with an error")
            for request_id in [r for r in self._live if not self.client.has_request(r)]:
                tracked = self._live.pop(request_id)
                if self.metrics is not None:
                    self.metrics.finished["error"].inc()
                self._call(tracked.outputs.put_nowait,
                           EngineStepError(f"the engine step failed: {err}"))
            self._snapshot()
            return
        self.steps += 1
        now = time.monotonic()
        deliveries = []
        for out in outputs:
            tracked = self._live.get(out.request_id)
            if tracked is None:
                continue  # aborted while the step ran
            try:
                self._account(tracked, out, now)
            except Exception:  # noqa: BLE001 - metrics only: the request goes on
                log.exception("could not update the metrics")
            if out.finished:
                del self._live[out.request_id]
            deliveries.append((tracked.outputs, out))
        if deliveries:
            self._call(_deliver, deliveries)
        self._snapshot()

    def _account(self, tracked: _Tracked, out: RequestOutput, now: float) -> None:
        m = self.metrics
        tokens = sum(len(c.token_ids) for c in out.outputs)
        new = tokens - tracked.tokens
        tracked.tokens = max(tokens, tracked.tokens)
        if m is None:
            return
        if new > 0:
            if tracked.first_token is None:
                tracked.first_token = now
                tracked.prompt_len = len(out.prompt_token_ids)
                m.ttft.observe(now - tracked.arrival)
                m.prompt_tokens.inc(tracked.prompt_len)
            else:
                m.tpot.observe(now - tracked.last_token)
            tracked.last_token = now
            m.generation_tokens.inc(new)
        if out.finished:
            m.e2e.observe(now - tracked.arrival)
            m.request_prompt_tokens.observe(tracked.prompt_len)
            m.request_generation_tokens.observe(tracked.tokens)
            reasons = [c.finish_reason for c in out.outputs]
            reason = "length" if "length" in reasons else (reasons[0] or "stop")
            m.finished.get(reason, m.finished["stop"]).inc()

    def _snapshot(self) -> None:
        try:
            self.stats = stats = self.client.stats()
            if self.metrics is not None:
                self.metrics.update_from_stats(stats)
        except Exception:  # noqa: BLE001 - the stats are for reading: serving goes on
            log.exception("could not read the engine's stats")

    def _call(self, fn, *args) -> None:
        """Run fn(*args) on the event loop (asyncio objects are not thread-safe)."""
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed: nobody is listening any more
            pass


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _deliver(deliveries: list) -> None:
    for q, out in deliveries:
        q.put_nowait(out)
