"""Request mapping: an OpenAI request body -> the engine's prompts and SamplingParams.

``RequestMapper.completion`` and ``RequestMapper.chat`` parse a decoded body (``protocol``: a
400 naming the first bad field), check the model name (404) and what SamplingParams does not
(text no tokenizer can encode), and return an ``EngineRequest``: the prompts, their
SamplingParams, and what shaping the answer needs to know of the request. They are coroutines
for one step: a structured output's params are made on a worker thread, as converting a big
JSON schema to a grammar can take seconds that the event loop (/health, every other client)
must not wait. The sampling values' limits are SamplingParams' alone (float32's range
included): serving maps its refusal, it does not check them again.

``refusal`` turns a refusal by SamplingParams or by the engine's ``add_request`` into a 400
naming the request's field. Both raise the typed errors of ``reference/engine/validation.py``,
which carry the field they are about, so no message is read for it.
"""

import asyncio
import re
from dataclasses import dataclass

from pagedllm.reference.engine.chat import chat_prompt
from pagedllm.reference.engine.client import ModelLimits
from pagedllm.reference.engine.sampling_params import SamplingParams
from pagedllm.reference.engine.structured_outputs import StructuredOutputsParams

from .protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
    structured_outputs_spec,
)


@dataclass
class EngineRequest:
    """One HTTP request as the engine takes it, and what its answer's shape depends on."""

    prompts: list  # one engine request each: text, or {"prompt_token_ids": [...]}
    params: SamplingParams
    prompt_field: str  # the request's field for the prompt: what the engine's "prompt" means
    chat: bool
    logprobs: int | None  # top logprobs per token; None: no logprobs
    include_usage: bool  # a stream's last chunk holds the usage
    stream: bool
    echo: bool = False  # completions: the prompt comes back before the completion
    generates: bool = True  # False: max_tokens 0 with echo, the prompt is only scored
    prompt_logprobs: int | None = None  # vLLM's field: the answer's prompt_logprobs, top k
    structured_field: str | None = None  # the request's field for its structured output


def refusal(err: Exception, prompt_field: str) -> APIError:
    """A refusal by SamplingParams or the engine as a 400 naming the request's field. The
    engine calls every prompt "prompt"; the request may call it otherwise ("messages" for
    chat, whose top_logprobs are the engine's logprobs). An error without a field is still the
    request's fault: a 400 naming no field."""
    field = getattr(err, "field", None)
    if field == "prompt":
        field = prompt_field
    elif field == "logprobs" and prompt_field == "messages":
        field = "top_logprobs"
    return APIError(400, str(err), field)


class RequestMapper:
    """Maps the bodies of /v1/completions and /v1/chat/completions for one served model."""

    def __init__(self, model_name: str, tokenizer, limits: ModelLimits):
        self.model_name, self.tokenizer = model_name, tokenizer
        self.max_model_len, self.vocab_size = limits.max_model_len, limits.vocab_size
        self.max_logprobs = limits.max_logprobs  # the engine's cap (-1: none); it checks k

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model `{model}` does not exist; this server serves "
                                f"`{self.model_name}` (GET /v1/models)", "model")

    def _prompt_logprobs(self, req) -> int | None:
        """vLLM's prompt_logprobs field: k, with -1 (the whole vocabulary) as the vocabulary's
        size where the engine's max_logprobs allows that many (``--max-logprobs -1``), as in
        vLLM; the engine checks every other k against the cap. Refused with stream, as vLLM
        refuses it (the entries come once, after the prefill, while a stream's chunks carry
        only new tokens)."""
        k = req.prompt_logprobs
        if k is None:
            return None
        if req.stream:
            raise APIError(400, "prompt_logprobs is not available with stream: true; leave "
                                "one of them out", "prompt_logprobs")
        if k < -1:
            raise APIError(400, f"prompt_logprobs must be -1 (the whole vocabulary) or >= 0, "
                                f"got {k}", "prompt_logprobs")
        if k == -1 and self.max_logprobs != -1 and self.vocab_size > self.max_logprobs:
            raise APIError(400, f"prompt_logprobs = -1 asks for the whole vocabulary "
                                f"({self.vocab_size} tokens), more than max_logprobs = "
                                f"{self.max_logprobs}: ask for at most {self.max_logprobs}, or "
                                "start the server with --max-logprobs -1", "prompt_logprobs")
        return self.vocab_size if k == -1 else k

    async def _params(self, req, max_tokens: int | None, logprobs: int | None,
                      prompt_field: str, prompt_logprobs: int | None = None) -> SamplingParams:
        """OpenAI's fields -> SamplingParams, whose own checks name the field (400).

        Values are passed as they came: SamplingParams refuses what the sampler cannot run (a
        temperature past float32's range), and the sampler reads a top_p below float32's
        smallest normal number, or a top_k of the vocabulary or more, as the nearest value it
        holds. Only vLLM's spelling is mapped: top_k 0 means all tokens, SamplingParams' -1."""
        top_k = -1 if req.top_k == 0 else req.top_k
        logit_bias = _logit_bias(req.logit_bias)
        structured = structured_outputs_spec(req)  # (spec's keywords, its field) or None
        # off the loop: the grammar is built (and kept for the compile thread) here
        spec = None if structured is None else await asyncio.to_thread(
            _structured_outputs, *structured)
        try:
            return SamplingParams(
                n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=top_k, seed=req.seed,
                max_tokens=max_tokens if max_tokens is not None else self.max_model_len,
                min_tokens=req.min_tokens, stop=req.stop, stop_token_ids=req.stop_token_ids,
                ignore_eos=req.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                repetition_penalty=req.repetition_penalty,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty, min_p=req.min_p,
                logit_bias=logit_bias, structured_outputs=spec)
        except (ValueError, TypeError) as err:
            raise refusal(err, prompt_field) from None

    # -- /v1/completions -----------------------------------------------------------------------
    async def completion(self, data) -> EngineRequest:
        req = parse_request(CompletionRequest, data)
        self._check_model(req.model)
        # echo with logprobs: the prompt's tokens' logprobs too (vLLM: prompt_logprobs =
        # logprobs). max_tokens 0 with echo scores the prompt and generates nothing: the
        # engine draws one token (as vLLM does), which the answer leaves out.
        max_tokens, generates = req.max_tokens, True
        if max_tokens == 0:
            if not req.echo:
                raise APIError(400, "max_tokens = 0 generates nothing: it is accepted only "
                                    "with echo: true (to score the prompt)", "max_tokens")
            max_tokens, generates = 1, False
        # the engine's k covers both echo's (logprobs) and prompt_logprobs' own
        prompt_k = self._prompt_logprobs(req)
        wanted = [k for k in (prompt_k, req.logprobs if req.echo else None) if k is not None]
        params = await self._params(req, max_tokens, req.logprobs, "prompt",
                                    prompt_logprobs=max(wanted) if wanted else None)
        prompt = req.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise APIError(400, "prompt is empty; give text or a list of token ids", "prompt")
        for p in prompts:
            if isinstance(p, str):
                check_utf8(p, "prompt")
        prompts = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts]
        return EngineRequest(prompts, params, "prompt", chat=False, logprobs=req.logprobs,
                             include_usage=_include_usage(req), stream=req.stream,
                             echo=req.echo, generates=generates, prompt_logprobs=prompt_k,
                             structured_field=_structured_field(req))

    # -- /v1/chat/completions ------------------------------------------------------------------
    async def chat(self, data) -> EngineRequest:
        req = parse_request(ChatCompletionRequest, data)
        self._check_model(req.model)
        if req.echo:
            raise APIError(400, "echo is not supported by /v1/chat/completions (a chat has no "
                                "prompt text to echo); use /v1/completions", "echo")
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise APIError(400, f"the model `{self.model_name}` has no chat template (it is not "
                                "a chat model): use /v1/completions with a plain prompt",
                           "messages")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        for i, message in enumerate(req.messages):
            check_utf8(message.as_dict()["content"], f"messages[{i}].content")
        try:
            prompt = chat_prompt(self.tokenizer, [m.as_dict() for m in req.messages],
                                 add_generation_prompt=req.add_generation_prompt)
        except (ValueError, TypeError) as err:
            raise APIError(400, str(err), "messages") from None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        if max_tokens is None:  # as many as the context leaves
            max_tokens = max(1, self.max_model_len - len(prompt["prompt_token_ids"]))
        prompt_k = self._prompt_logprobs(req)
        params = await self._params(req, max_tokens, logprobs, "messages",
                                    prompt_logprobs=prompt_k)
        return EngineRequest([prompt], params, "messages", chat=True, logprobs=logprobs,
                             include_usage=_include_usage(req), stream=req.stream,
                             prompt_logprobs=prompt_k, structured_field=_structured_field(req))


def _structured_outputs(kwargs: dict, param: str) -> StructuredOutputsParams:
    """StructuredOutputsParams from the request's spec; its refusal (xgrammar's reason) is a
    400 naming the request's own field: response_format.json_schema.schema, guided_json..."""
    try:
        return StructuredOutputsParams(**kwargs)
    except ValueError as err:
        message = str(err)
        if param != "structured_outputs":  # the engine's name for it -> the request's
            message = message.replace(f"structured_outputs.{next(iter(kwargs))}", param)
        raise APIError(400, message, param) from None


def _structured_field(req) -> str | None:
    """The request's field for its structured output, as an error names it (the spec is
    already known to be well formed)."""
    structured = structured_outputs_spec(req)
    return None if structured is None else structured[1]


# ASCII digits, at most 20 (past int64 either way): str.isdigit() passes "²" and "①", which
# int() refuses, and int() reads "٣" as 3 and refuses 4300 digits or more.
_TOKEN_ID = re.compile(r"-?[0-9]{1,20}")


def _logit_bias(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias keys are token ids written as strings (JSON keys are strings):
    {"50256": -100} -> {50256: -100.0}; SamplingParams and the engine check the rest (ids
    >= 0 and in the vocabulary, finite values in [-100, 100])."""
    if not logit_bias:
        return None
    ids = {}
    for key, value in logit_bias.items():
        if not _TOKEN_ID.fullmatch(key.strip()):
            raise APIError(400, f"logit_bias keys must be token ids (integers written as "
                                f"strings), got {key!r:.40}", "logit_bias")
        ids[int(key)] = value
    return ids


def _include_usage(req) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def check_utf8(text: str, field: str) -> None:
    """JSON can spell a lone UTF-16 surrogate (\\ud800), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise APIError(400, f"{field} holds a character that is not valid Unicode (a lone "
                            f"surrogate, {text[err.start]!r}) at position {err.start}",
                       field) from None
