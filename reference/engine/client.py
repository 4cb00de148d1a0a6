"""The engine client: everything a front end (the HTTP server, a data-parallel router) may ask
of an engine, and nothing more (vLLM's ``EngineClient``; mini-sglang's typed messages).

``LLMEngine`` implements it in-process; ``serving.data_parallel``'s replica proxy implements it
for an engine in another process, carrying each call over a pipe. A front end that uses only
these names runs over either without knowing which it has, and without reading the engine's
queues, its KV manager or its configuration.
"""

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from .outputs import RequestOutput


@dataclass(frozen=True)
class ModelLimits:
    """What a front end checks a request against before sending it (the engine checks again,
    and is the authority)."""

    max_model_len: int  # prompt + output tokens of one sequence
    vocab_size: int  # token ids must be below it
    max_logprobs: int  # logprobs / prompt_logprobs at most this (-1: the vocabulary)


@runtime_checkable
class EngineClient(Protocol):
    tokenizer: Any  # the model's tokenizer (Hugging Face's), or None

    @property
    def limits(self) -> ModelLimits: ...

    def add_request(self, request_id: str, prompt, params) -> None:
        """Queue a request; a refused one raises ValueError / TypeError naming the field."""

    def abort_request(self, request_id: str) -> None:
        """Remove a request the engine holds (its blocks go back to the pool)."""

    def has_request(self, request_id: str) -> bool:
        """Does the engine still hold this request (not finished, not aborted)?"""

    def step(self) -> list[RequestOutput]:
        """Run one iteration: the outputs of the requests it touched."""

    def has_unfinished_requests(self) -> bool: ...

    def stats(self) -> dict:
        """Blocks, queues, counters (the ``LLM.stats()`` dictionary)."""

    def check_health(self) -> None:
        """Raise if the engine cannot run a step (a rank or a replica has died)."""

    def shutdown(self) -> None:
        """End whatever the engine started (ranks, threads). Safe to call twice."""
