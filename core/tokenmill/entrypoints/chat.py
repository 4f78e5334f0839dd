"""Rendering chat messages through the model's chat template."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenmill.errors import InvalidRequestError

Message = dict[str, Any]


def render_chat(tokenizer: Any, messages: Sequence[Message], chat_template: str | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                tools: list[dict[str, Any]] | None = None) -> str:
    """The prompt text for ``messages``; a template that cannot render them is a 400, not a crash."""
    if tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer to apply a chat template with", param="messages")
    if not messages:
        raise InvalidRequestError("messages must not be empty", param="messages")
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError("continue_final_message and add_generation_prompt are mutually exclusive",
                                  param="continue_final_message")
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise InvalidRequestError("the model has no chat template; pass one with --chat-template", param="messages")
    try:
        return tokenizer.apply_chat_template(
            [_flatten_content(m) for m in messages],
            chat_template=template,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
    except Exception as exc:  # jinja errors, template raise_exception(...)
        raise InvalidRequestError(f"the chat template cannot render these messages: {exc}", param="messages") from exc


def _flatten_content(message: Message) -> Message:
    """OpenAI content may be a list of parts; text parts are joined for text-only templates."""
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise InvalidRequestError("only text content parts are supported by this model", param="messages")
            texts.append(part.get("text", ""))
        message = {**message, "content": "".join(texts)}
    return message
