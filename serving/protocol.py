"""The HTTP API's shapes: OpenAI's request and response bodies, and its error body.

Requests are validated strictly (``"max_tokens": "16"`` is refused, not read as 16), and an
unknown field is ignored, as OpenAI's own clients send fields this engine has no use for
(``user``, ...). A field the engine cannot honour at a non-default value (``suffix``, chat's
``echo``, ...) is refused with a 400 naming it rather than silently ignored.

Every error answers with OpenAI's error body, which the ``openai`` client turns into its
exceptions (``openai.BadRequestError`` and friends)::

    {"error": {"message": "top_p must be in (0, 1], got 2.0", "type": "invalid_request_error",
               "param": "top_p", "code": null}}
"""

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               408: "timeout_error", 413: "invalid_request_error", 500: "internal_server_error"}


class APIError(Exception):
    """An answer other than 200: its status code, message and the request field it concerns."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """Every error answer's body. Its text may quote the request, and JSON can spell a lone
    UTF-16 surrogate (\\ud800) that no UTF-8 body can hold (the response failed, a 500): such a
    character is written as its escape, here, the one place error bodies are built."""
    return {"error": {"message": _encodable(message),
                      "type": ERROR_TYPES.get(status, "api_error"),
                      "param": None if param is None else _encodable(param), "code": status}}


def _encodable(text: str) -> str:
    """text with each character UTF-8 cannot encode (a lone surrogate) as its \\uXXXX escape."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None  # None: the served model
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # vLLM's extension; 0 and -1 both mean "all tokens"
    min_tokens: int = 0  # vLLM's extension
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM's extension
    ignore_eos: bool = False  # vLLM's extension: benchmarks ask for exact output lengths
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0  # [-2, 2], over the output tokens
    frequency_penalty: float = 0.0  # [-2, 2], over the output tokens
    repetition_penalty: float = 1.0  # vLLM's extension: > 0, 1 is off
    min_p: float = 0.0  # vLLM's extension: [0, 1]
    best_of: int | None = None  # not implemented: refused unless None or n
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> [-100, 100]
    # vLLM's extension: every prompt token's logprob and the top k (-1: the whole
    # vocabulary), as "prompt_logprobs" in the answer; not with stream
    prompt_logprobs: int | None = None
    user: str | None = None
    bad_words: list[str] | None = None  # vLLM's; not implemented: refused unless empty
    allowed_token_ids: list[int] | None = None  # vLLM's; not implemented: refused unless None
    # Structured outputs (at most one of them; structured_outputs_spec below): OpenAI's
    # {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema"}};
    # vLLM's extra body field {"json" | "regex" | "choice" | "grammar": ...}, and its older
    # guided_* fields
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None  # top logprobs per token (OpenAI allows up to 5; we allow more)
    echo: bool = False  # the prompt (text, and with logprobs its tokens') before the completion
    suffix: str | None = None  # not implemented: refused unless None


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):  # text parts, joined as vLLM joins them
            content = "\n".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to max_model_len
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # vLLM's extension
    tools: list | None = None  # not implemented: refused unless empty
    echo: bool = False  # completions only: refused unless False (request_mapping.py)


UNSUPPORTED = {  # field: (the value that is accepted, what to say)
    "suffix": (None, "suffix is not supported by this engine"),
    "allowed_token_ids": (None, "allowed_token_ids is not supported by this engine; "
                                "structured_outputs.choice or .regex can limit the output"),
}


def parse_request(cls: type[_Request], data: Any) -> _Request:
    """A request model from decoded JSON, or an APIError(400) naming the first bad field."""
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got "
                            f"{type(data).__name__}")
    try:
        request = cls.model_validate(data, strict=True)
    except ValidationError as err:
        first = err.errors()[0]
        param = field_path(first["loc"])
        if first["type"] == "missing":
            raise APIError(400, f"{param} is required", param) from None
        got = first.get("input")
        raise APIError(400, f"{param}: {first['msg']}, got {got!r:.60}", param) from None
    for name, (default, message) in UNSUPPORTED.items():
        if name in cls.model_fields and getattr(request, name) != default:
            raise APIError(400, message, name)
    if getattr(request, "bad_words", None):
        raise APIError(400, "bad_words is not supported by this engine; logit_bias can ban "
                            "single tokens", "bad_words")
    if getattr(request, "tools", None):
        raise APIError(400, "tools are not supported by this engine (no tool calling); leave "
                            "them out", "tools")
    best_of = getattr(request, "best_of", None)  # the tokenizer endpoints' bodies have none
    if best_of is not None and best_of != request.n:
        raise APIError(400, "best_of is not supported by this engine; use n", "best_of")
    return request


# -- structured outputs ------------------------------------------------------------------------
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}


def structured_outputs_spec(request) -> tuple[dict, str] | None:
    """The request's structured output as StructuredOutputsParams' keyword arguments, and
    the request field that names it in an error (its "param"); None without one.

    response_format (other than {"type": "text"}), structured_outputs and the guided_*
    fields each ask for one; more than one of them is a 400 naming the second. The spec
    itself (a valid schema, regex, grammar) is checked by StructuredOutputsParams."""
    found = []
    fmt = getattr(request, "response_format", None)
    if fmt is not None and fmt != {"type": "text"}:
        found.append(_response_format(fmt))
    so = getattr(request, "structured_outputs", None)
    if so is not None:
        unknown = [k for k, v in so.items() if k not in STRUCTURED_KINDS and v is not None]
        if unknown:
            raise APIError(400, f"structured_outputs.{unknown[0]} is not supported by this "
                                f"engine; give one of {', '.join(STRUCTURED_KINDS)}",
                           f"structured_outputs.{unknown[0]}")
        found.append(({k: v for k, v in so.items() if v is not None}, "structured_outputs"))
    for name, kind in GUIDED.items():
        value = getattr(request, name, None)
        if value is not None:
            found.append(({kind: value}, name))
    if len(found) > 1:
        first, second = found[0][1].split(".")[0], found[1][1].split(".")[0]
        raise APIError(400, f"{second} and {first} both ask for a structured output; give "
                            "one of them", second)
    return found[0] if found else None


def _response_format(fmt: dict) -> tuple[dict, str]:
    kind = fmt.get("type")
    if kind == "json_object":
        return {"json_object": True}, "response_format"
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise APIError(400, "response_format.json_schema is required with type "
                                "json_schema: {\"name\": ..., \"schema\": {...}}",
                           "response_format.json_schema")
        if spec.get("schema") is None:
            raise APIError(400, "response_format.json_schema.schema is required: the JSON "
                                "schema the output must follow",
                           "response_format.json_schema.schema")
        return {"json": spec["schema"]}, "response_format.json_schema.schema"
    raise APIError(400, f"response_format.type must be 'text', 'json_object' or "
                        f"'json_schema', got {kind!r:.40}", "response_format")


def field_path(loc: tuple) -> str:
    """('messages', 0, 'content', 'str') -> 'messages[0].content': the field as a user wrote it.
    pydantic adds the name of each union member it tried; those are not fields."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in ("str", "list[int]", "list[str]", "list[list[int]]", "list[TextPart]",
                      "int", "float", "bool", "none", "function-after", "dict", "list") \
                or "[" in str(part):
            break  # a union member's name: the field ends here
        else:
            path += ("." if path else "") + str(part)
    return path or "body"


# -- responses ---------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
