"""A Messages API request as the chat request it stands for, so that it generates through the chat
path (``chat.generate_chat``): turns become chat messages, tools and ``tool_choice`` take chat's form.

A ``tool_use`` block is a tool call of its assistant message (``input`` as JSON text), a
``tool_result`` block a ``tool`` message answering it; a last assistant turn is a prefill: the
model continues it (``continue_final_message``), as Anthropic's API does.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tokenmill.errors import InvalidRequestError
from tokenmill.structured_output import StructuredOutputsParams
from tokenmill_cli.server.messages_protocol import (
    CountTokensRequest,
    MessageParam,
    OutputConfig,
    TextBlockParam,
    ThinkingBlockParam,
    ToolChoiceAny,
    ToolChoiceNone,
    ToolChoiceParam,
    ToolChoiceTool,
    ToolParam,
    ToolResultBlockParam,
    ToolResultContent,
    ToolUseBlockParam,
)
from tokenmill_cli.server.protocol import (
    AssistantMessage,
    ChatMessage,
    ChatRendering,
    SystemMessage,
    ToolMessage,
    UserMessage,
)
from tokenmill_cli.server.response_format import Constraint


def chat_messages(system: str | list[TextBlockParam] | None, turns: Sequence[MessageParam]) -> list[ChatMessage]:
    """The chat messages of ``system`` (a system message first) and ``turns``.

    A user turn's text blocks (joined) are a user message and its ``tool_result`` blocks ``tool``
    messages, in the order given; an assistant turn is one message, its text then its calls;
    ``thinking`` blocks are left out (wherever they stand), as chat templates drop the reasoning
    of earlier turns.
    """
    text = _text(system, "system") if system is not None else ""
    messages: list[ChatMessage] = [SystemMessage(role="system", content=text)] if text else []
    for index, turn in enumerate(turns):
        where = f"messages[{index}]"
        if isinstance(turn.content, str):
            messages.append(AssistantMessage(role="assistant", content=turn.content) if turn.role == "assistant"
                            else UserMessage(role="user", content=turn.content))
        elif turn.role == "assistant":
            messages.append(_assistant_message(turn.content, where))
        else:
            messages += _user_messages(turn.content, where)
    return messages


def _assistant_message(blocks: Sequence[Any], where: str) -> ChatMessage:
    texts, calls = [], []
    for block in blocks:
        if isinstance(block, TextBlockParam):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlockParam):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input)}})
        elif not isinstance(block, ThinkingBlockParam):
            raise _unsupported(block, where, "an assistant turn holds text, tool_use and thinking blocks")
    return AssistantMessage(role="assistant", content="".join(texts) if texts or not calls else None,
                       tool_calls=calls or None)


def _user_messages(blocks: Sequence[Any], where: str) -> list[ChatMessage]:
    messages: list[ChatMessage] = []
    texts: list[str] = []
    for block in blocks:
        if isinstance(block, TextBlockParam):
            texts.append(block.text)
            continue
        if isinstance(block, ThinkingBlockParam):
            continue  # left out wherever it stands, as in an assistant turn
        if not isinstance(block, ToolResultBlockParam):
            raise _unsupported(block, where, "a user turn holds text, tool_result and thinking blocks")
        if texts:
            messages.append(UserMessage(role="user", content="".join(texts)))
            texts = []
        messages.append(ToolMessage(role="tool", tool_call_id=block.tool_use_id,
                                    content=_text(block.content, f"{where}.content")))
    if texts or not messages:
        messages.append(UserMessage(role="user", content="".join(texts)))
    return messages


def _text(content: ToolResultContent | list[TextBlockParam], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for block in content:
        if not isinstance(block, TextBlockParam):
            raise _unsupported(block, where, "only text blocks are")
        texts.append(block.text)
    return "".join(texts)


def _unsupported(block: Any, where: str, allowed: str) -> InvalidRequestError:
    return InvalidRequestError(f"{where}: content blocks of type {block.type!r} are not supported here ({allowed}; "
                               "this text model reads no images or documents)", param="messages")


def rendering(body: CountTokensRequest) -> ChatRendering:
    """A last assistant turn is continued (Anthropic's prefill); otherwise a new assistant turn opens."""
    last = body.messages[-1]
    prefill = last.role == "assistant"
    if prefill and not isinstance(last.content, str) and any(isinstance(b, ToolUseBlockParam) for b in last.content):
        raise InvalidRequestError("the last turn is an assistant turn ending in tool_use: send its tool_result "
                                  "in a user turn", param="messages")
    return ChatRendering(add_generation_prompt=not prefill, continue_final_message=prefill, chat_template=None,
                         tools=chat_tools(body.tools))


def chat_tools(tools: list[ToolParam] | None) -> list[dict[str, Any]] | None:
    """Client tools in chat's form (``{"type": "function", "function": {name, description, parameters}}``)."""
    if not tools:
        return None
    converted = []
    for tool in tools:
        function = {"name": tool.name, "description": tool.description, "parameters": tool.input_schema}
        converted.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
    return converted


def chat_tool_choice(choice: ToolChoiceParam | None) -> tuple[Any, bool]:
    """Chat's ``tool_choice`` and ``parallel_tool_calls``: ``any`` is ``required``, ``tool`` a named function."""
    if choice is None:
        return None, True
    parallel = not getattr(choice, "disable_parallel_tool_use", False)
    if isinstance(choice, ToolChoiceTool):
        return {"type": "function", "function": {"name": choice.name}}, parallel
    if isinstance(choice, ToolChoiceAny):
        return "required", parallel
    if isinstance(choice, ToolChoiceNone):
        return "none", parallel
    return "auto", parallel


def tool_input(arguments: str) -> dict[str, Any]:
    """A parsed call's arguments (JSON text, an object from every tool-call parser) as ``input``."""
    try:
        parsed = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def output_constraint(config: OutputConfig | None) -> Constraint | None:
    """``output_config.format``: the text held to its JSON schema (the structured-output grammar)."""
    if config is None or config.format is None:
        return None
    return Constraint(StructuredOutputsParams(json=config.format.json_schema), "output_config.format.schema")
