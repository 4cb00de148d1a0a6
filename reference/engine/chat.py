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
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise ValueError(f"messages[{i}] must be a dict with a string 'role' and a string "
                             f"'content', e.g. {{'role': 'user', 'content': 'Hello'}}; got "
                             f"{message!r:.80}")
    return list(messages)


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
    text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return {"prompt": text, "prompt_token_ids": ids}
