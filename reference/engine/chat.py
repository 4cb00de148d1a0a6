"""Chat prompts: a conversation of messages turned into the one prompt a chat model was trained on.

A chat model sees a conversation as text with role markers, written by the checkpoint's chat
template (a Jinja template in its tokenizer files). SmolLM2 writes, for instance::

    <|im_start|>user
    What is a KV cache?<|im_end|>
    <|im_start|>assistant

and the model continues after the last line. The engine itself knows nothing of chat: it
receives the template's tokens as an ordinary prompt.
"""


def check_conversation(messages) -> list[dict]:
    """A conversation: a non-empty list of {"role": ..., "content": str} dicts."""
    if not isinstance(messages, list | tuple) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} "
                         "dicts")
    checked = []
    for i, message in enumerate(messages):
        if isinstance(message, dict) and _is_text_parts(message.get("content")):
            # OpenAI's (and vLLM's) other form: [{"type": "text", "text": ...}, ...]; the
            # templates expect one string, so the text parts are joined as vLLM joins them.
            message = {**message, "content": "\n".join(p["text"] for p in message["content"])}
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise ValueError(f"messages[{i}] must be a dict with a string 'role' and a string "
                             f"'content' (or a list of {{'type': 'text', 'text': ...}} parts), "
                             f"e.g. {{'role': 'user', 'content': 'Hello'}}; got {message!r:.80}")
        checked.append(message)
    return checked


def _is_text_parts(content) -> bool:
    return isinstance(content, list) and bool(content) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content)


def chat_template_of(tokenizer, chat_template: str | None = None) -> str:
    """The template to use: the one given, else the checkpoint's; a clear error if neither."""
    if tokenizer is None:
        raise ValueError("this model folder has no tokenizer, so it has no chat template: use "
                         "generate() with token ids")
    template = chat_template or tokenizer.chat_template
    if not template:
        raise ValueError("this model's tokenizer has no chat template (it is not a chat "
                         "model): use generate() with a plain prompt, or pass chat_template=")
    return template


def chat_prompt(tokenizer, messages, chat_template: str | None = None,
                add_generation_prompt: bool = True) -> dict:
    """The engine prompt {"prompt": text, "prompt_token_ids": ids} of one conversation.

    The template's text already holds every special token it wants, so it is tokenized without
    adding any (a second BOS would be a token the model never saw in training).
    """
    messages = check_conversation(messages)
    template = chat_template_of(tokenizer, chat_template)
    from jinja2 import TemplateError

    try:
        text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except TemplateError as err:  # the template refuses the conversation, or does not parse
        raise ValueError(f"the chat template failed on this conversation "
                         f"({type(err).__name__}: {err})") from err
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return {"prompt": text, "prompt_token_ids": ids}
