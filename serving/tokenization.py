"""The tokenizer endpoints, in vLLM's shapes: ``POST /tokenize``, ``POST /detokenize``,
``GET /tokenizer_info``.

A client that counts tokens, builds prompts from token ids or scores them needs the server's
own tokenizer; these let it use the server's instead of loading a copy (lm-evaluation-harness's
``local-completions`` can: it reads ``/tokenizer_info`` for ``eos_token`` and the chat template
and encodes and decodes through ``/tokenize`` and ``/detokenize``)::

    POST /tokenize    {"prompt": "Hello", "add_special_tokens": true}
                   or {"messages": [...], "add_generation_prompt": true}
                   -> {"count": 2, "max_model_len": 1024, "tokens": [9906, 0],
                       "token_strs": null}          (the strings with "return_token_strs")
    POST /detokenize  {"tokens": [9906, 0]}  -> {"prompt": "Hello"}
    GET /tokenizer_info  -> {"tokenizer_class": ..., "eos_token": ..., "chat_template": ...,
                             and the rest of the tokenizer's configuration}

As in vLLM, a text prompt gets the tokenizer's special tokens (``add_special_tokens`` defaults to
true) and a conversation none (the chat template writes its own). Bad input is a 400 naming the
field, as everywhere in the server.
"""

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.reference.engine.chat import chat_prompt
from pagedllm.reference.engine.client import ModelLimits

from .protocol import APIError, ChatMessage, parse_request
from .request_mapping import check_utf8


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the template writes its own
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    tokens: list[int]


def _json_safe(value):
    """A tokenizer's configuration value as JSON: AddedToken as its text, keys as strings."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    content = getattr(value, "content", None)  # tokenizers' AddedToken
    return content if isinstance(content, str) else str(value)


class Tokenization:
    """The three endpoints for one served model's tokenizer."""

    def __init__(self, model_name: str, tokenizer, limits: ModelLimits):
        self.model_name, self.tokenizer = model_name, tokenizer
        self.max_model_len, self.vocab_size = limits.max_model_len, limits.vocab_size

    def _check(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model `{model}` does not exist; this server serves "
                                f"`{self.model_name}` (GET /v1/models)", "model")
        if self.tokenizer is None:
            raise APIError(400, f"the model `{self.model_name}` has no tokenizer: send and "
                                "read token ids")

    def tokenize(self, data) -> dict:
        chat = isinstance(data, dict) and "messages" in data
        req = parse_request(TokenizeChatRequest if chat else TokenizeCompletionRequest, data)
        self._check(req.model)
        if chat:
            for i, message in enumerate(req.messages):
                check_utf8(message.as_dict()["content"], f"messages[{i}].content")
            if not self.tokenizer.chat_template:
                raise APIError(400, f"the model `{self.model_name}` has no chat template: "
                                    "tokenize a plain prompt", "messages")
            try:
                text = chat_prompt(self.tokenizer, [m.as_dict() for m in req.messages],
                                   add_generation_prompt=req.add_generation_prompt)["prompt"]
            except (ValueError, TypeError) as err:
                raise APIError(400, str(err), "messages") from None
        else:
            check_utf8(req.prompt, "prompt")
            text = req.prompt
        tokens = self.tokenizer(text, add_special_tokens=req.add_special_tokens)["input_ids"]
        token_strs = self.tokenizer.convert_ids_to_tokens(tokens) \
            if req.return_token_strs else None
        return {"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens,
                "token_strs": token_strs}

    def detokenize(self, data) -> dict:
        req = parse_request(DetokenizeRequest, data)
        self._check(req.model)
        bad = [t for t in req.tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"tokens {bad[:5]} are outside the vocabulary; valid ids are "
                                f"0..{self.vocab_size - 1}", "tokens")
        return {"prompt": self.tokenizer.decode(req.tokens)}

    def tokenizer_info(self) -> dict:
        """vLLM's answer: the tokenizer's init configuration, its class, and the chat
        template; the special tokens are written out even where the configuration leaves
        them to the tokenizer's defaults."""
        self._check(None)
        tok = self.tokenizer
        info = {k: _json_safe(v) for k, v in tok.init_kwargs.items()
                if k != "added_tokens_decoder"}  # every added token: long, and in /tokenize
        info["tokenizer_class"] = type(tok).__name__
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            value = getattr(tok, name, None)
            if value is not None:
                info[name] = _json_safe(value)
        if tok.chat_template:
            info["chat_template"] = tok.chat_template
        return info
