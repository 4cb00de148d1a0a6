"""The messages serving passes between threads and processes: one dataclass per kind, so a
receiver dispatches on the message's type (``match``) and every field has a name (no
``command[5]``). mini-sglang's typed messages, vLLM's ``EngineCoreRequest`` and friends.

Two channels carry them::

    event loop ──SubmitRequest / AbortRequest──> engine thread       (AsyncLLMEngine: a queue)
    front end  ──AddRequest / AbortRequest / Step / Stop──> replica  (data_parallel: a pipe)
    front end  <──Ready | LoadFailed, then one Reply per call──  replica

Everything that crosses the pipe is pickled, so those messages hold plain values and the
engine's own objects (SamplingParams, RequestOutput, ModelLimits), and are frozen: a message is
what was sent, never changed on the way.
"""

import asyncio
from dataclasses import dataclass
from typing import Any

from pagedllm.reference.engine.client import ModelLimits


# -- calls on an engine (EngineClient's methods, as messages) -------------------------------------
@dataclass(frozen=True)
class AddRequest:
    """``add_request(request_id, prompt, params)``."""

    request_id: str
    prompt: Any  # text, or {"prompt_token_ids": [...]}
    params: Any  # SamplingParams


@dataclass(frozen=True)
class AbortRequest:
    """``abort_request(request_id)``: the engine frees the request's blocks."""

    request_id: str


@dataclass(frozen=True)
class Step:
    """``step()``: the answer's result is the step's list of RequestOutput."""


@dataclass(frozen=True)
class Stop:
    """End the replica (after the call in progress); it sends no answer."""


# -- the engine thread's own (one process: asyncio objects, never pickled) ------------------------
@dataclass(frozen=True)
class SubmitRequest:
    """An add from the event loop: the request, the queue its outputs go to, and the future
    that learns whether the engine took it (None) or refused it (the error)."""

    request: AddRequest
    outputs: asyncio.Queue
    accepted: asyncio.Future
    arrival: float  # time.monotonic() when the HTTP request came in (TTFT counts from here)


# -- a replica's answers ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ReplicaState:
    """What the front end keeps of a replica after every answer, so that reading it (the
    router, /health, /metrics) never waits on the pipe."""

    request_ids: frozenset[str]  # the requests its engine holds (has_request)
    unfinished: bool  # has_unfinished_requests()
    stats: dict  # stats()
    health: str | None  # None if check_health() passed, else its error's text


@dataclass(frozen=True)
class ReplicaInfo:
    """What does not change while a replica runs: sent once, when it has loaded."""

    tokenizer: Any  # Hugging Face's tokenizer (it pickles), or None
    model_dir: str
    limits: ModelLimits


@dataclass(frozen=True)
class Ready:
    """The replica loaded its engine and waits for calls."""

    info: ReplicaInfo
    state: ReplicaState


@dataclass(frozen=True)
class LoadFailed:
    """The replica could not load: its error (raised again in the front end) and its traceback
    (the raised error's cause)."""

    error: BaseException
    traceback: str


@dataclass(frozen=True)
class Reply:
    """The answer to one call: its result, or the error it raised (raised again in the front
    end, as if called there), and the replica's state after it."""

    state: ReplicaState
    result: Any = None
    error: BaseException | None = None
