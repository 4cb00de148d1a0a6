"""``POST /generate``: the body and the answer of vLLM's demo server, beside the OpenAI routes.

vLLM ships two HTTP servers. ``vllm serve`` (``vllm/entrypoints/openai/api_server.py``) speaks
OpenAI's API, as pagedllm's routes do. The older ``python -m vllm.entrypoints.api_server``
(``vllm/entrypoints/api_server.py``, "for demo purposes") has one route, and seed 003's
deployment command starts it, so scripts written against it post here:

    request   {"prompt": "text", "stream": false, ...any SamplingParams field}
    answer    {"text": ["prompt + completion", ...]}         one string per sample (n)
    stream    the same object after every step, the text so far, one JSON line each

The prompt is echoed in front of every completion, as the demo server does; a field that is not
one of SamplingParams' is a 400 naming it (the demo server would fail with a 500). The request
runs through the engine, the timeout and the disconnect watch of the other routes
(``responses.EngineResponse``); only the shape differs (``DemoRun``).
"""

import dataclasses
import json
from dataclasses import dataclass

from pagedllm.reference.engine.sampling_params import SamplingParams

from .protocol import APIError
from .responses import RequestRun

SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.init)


@dataclass
class DemoRequest:
    prompts: list[str]  # one prompt: the demo server takes one
    params: SamplingParams
    stream: bool


def demo_request(data) -> DemoRequest:
    """The demo server's body as the engine's request; a 400 naming the field otherwise."""
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object: {\"prompt\": \"...\", ...}")
    fields = dict(data)
    prompt = fields.pop("prompt", None)
    if not isinstance(prompt, str) or not prompt:
        raise APIError(400, "prompt must be a non-empty string", "prompt")
    stream = fields.pop("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, f"stream must be true or false, got {stream!r}", "stream")
    unknown = [name for name in fields if name not in SAMPLING_FIELDS]
    if unknown:
        raise APIError(400, f"{unknown[0]!r} is not a field of /generate: it takes prompt, "
                            f"stream and SamplingParams' fields ({', '.join(SAMPLING_FIELDS)})",
                       unknown[0])
    try:
        params = SamplingParams(**fields)
    except (TypeError, ValueError) as err:
        raise APIError(400, str(err), getattr(err, "field", None)) from None
    return DemoRequest([prompt], params, stream)


class DemoRun(RequestRun):
    """The answer in the demo server's shape: every sample's prompt + text, whole each time."""

    # the demo server's stream: one JSON object a line (older releases ended each with "\0")
    STREAM_TYPE = b"application/x-ndjson"
    STREAM_END = b""

    def texts(self, out) -> list[str]:
        """prompt + completion, one per sample, in the samples' order."""
        prompt = self._prompt_text(out)
        return [prompt + c.text for c in sorted(out.outputs, key=lambda c: c.index)]

    def body(self) -> dict:
        return {"text": [t for request_id in self.ids
                         for t in self.texts(self.final[request_id])]}

    def first_events(self) -> list[bytes]:
        return []

    def events(self, out) -> list[bytes]:
        return [_line({"text": self.texts(out)})]

    def last_events(self) -> list[bytes]:
        return []

    def error_event(self, body: dict) -> bytes:
        return _line(body)


def _line(body: dict) -> bytes:
    return json.dumps(body).encode() + b"\n"
