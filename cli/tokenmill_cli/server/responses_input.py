"""A Responses API request as the chat request it stands for, so that it generates through the
chat path (``chat.generate_chat``): items become chat messages, tools and ``tool_choice`` take
chat's form, and ``text.format`` becomes a structured-output constraint.

The conversation a response continues (``previous_response_id``) is a list of input items;
a response's output items join it as input items (:func:`as_input_items`), the form a client
would send them back in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenmill.errors import InvalidRequestError
from tokenmill.structured_output import StructuredOutputsParams
from tokenmill_cli.server.protocol import AssistantMessage, ChatMessage, SystemMessage, ToolMessage, UserMessage
from tokenmill_cli.server.response_format import Constraint, request_constraint
from tokenmill_cli.server.responses_objects import OutputFunctionCall, OutputItem, OutputMessage
from tokenmill_cli.server.responses_protocol import (
    Content,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    FunctionToolChoice,
    InputItem,
    MessageItem,
    OtherItem,
    ReasoningItem,
    TextConfig,
    TextFormatJSONObject,
    TextFormatJSONSchema,
    TextPart,
    Tool,
    ToolChoiceParam,
)


def input_items(value: str | list[InputItem]) -> list[InputItem]:
    """Text input is one user message."""
    return [MessageItem(role="user", content=value)] if isinstance(value, str) else list(value)


def chat_messages(instructions: str | None, items: Sequence[InputItem]) -> list[ChatMessage]:
    """The chat messages of ``instructions`` (a system message first) and ``items``.

    A ``developer`` message is a system message (chat templates know no developer role); a
    ``function_call`` joins the assistant turn before it (text then calls, as the model wrote
    them) or opens one; a ``function_call_output`` is a ``tool`` message; reasoning items are
    left out, as chat templates drop the reasoning of earlier turns.
    """
    messages: list[ChatMessage] = [SystemMessage(role="system", content=instructions)] if instructions else []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append(_message(item.role, _with_images(item.content) or _text(item.content)))
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and isinstance(messages[-1], AssistantMessage):
                messages[-1].tool_calls = [*(messages[-1].tool_calls or []), call]
            else:
                messages.append(AssistantMessage(role="assistant", tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(ToolMessage(role="tool", tool_call_id=item.call_id, content=_text(item.output)))
        elif isinstance(item, OtherItem):
            raise InvalidRequestError(f"input items of type {item.type!r} are not supported: only messages, "
                                      "function_call and function_call_output items are", param="input")
        else:
            assert isinstance(item, ReasoningItem)
    return messages


def _with_images(content: Content) -> list[dict[str, Any]] | None:
    """A content with ``input_image`` parts as chat content parts (text and ``image_url``, in
    order), for a multimodal model; None for a content without images."""
    if isinstance(content, str) or not any(part.type == "input_image" for part in content):
        return None
    parts: list[dict[str, Any]] = []
    for part in content:
        if isinstance(part, TextPart):
            parts.append({"type": "text", "text": part.text})
            continue
        url = getattr(part, "image_url", None)
        if part.type != "input_image" or not isinstance(url, str):
            raise InvalidRequestError(f"a {part.type!r} part is not supported here: input_text, output_text and "
                                      "input_image (with an image_url string) are", param="input")
        parts.append({"type": "image_url", "image_url": {"url": url}})
    return parts


def _message(role: str, text: str | list[dict[str, Any]]) -> ChatMessage:
    """A message item as the chat message of its role (a developer message is a system one)."""
    if not isinstance(text, str):  # content parts with images
        if role != "user":
            raise InvalidRequestError(f"only user messages may hold input_image parts, not {role} ones", param="input")
        return UserMessage.model_validate({"role": "user", "content": text})
    if role == "assistant":
        return AssistantMessage(role="assistant", content=text)
    if role == "user":
        return UserMessage(role="user", content=text)
    return SystemMessage(role="system", content=text)


def _text(content: Content) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if not isinstance(part, TextPart):
            if part.type in ("input_text", "output_text"):
                raise InvalidRequestError(f"an {part.type} part needs its text (a string)", param="input")
            raise InvalidRequestError(f"content parts of type {part.type!r} are not supported by this text model: "
                                      "only input_text and output_text parts are", param="input")
        texts.append(part.text)
    return "".join(texts)  # as chat's text parts are joined (entrypoints.chat)


def as_input_items(output: Sequence[OutputItem]) -> list[InputItem]:
    """A response's output items as the input items that continue its conversation."""
    items: list[InputItem] = []
    for item in output:
        if isinstance(item, OutputMessage):
            items.append(MessageItem(role="assistant", content="".join(part.text for part in item.content),
                                     id=item.id))
        elif isinstance(item, OutputFunctionCall):
            items.append(FunctionCallItem(type="function_call", call_id=item.call_id, name=item.name,
                                          arguments=item.arguments, id=item.id))
        # a reasoning item is left out: chat templates drop the reasoning of earlier turns
    return items


def chat_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """Function tools in chat's form (``{"type": "function", "function": {...}}``); a built-in tool is a 400."""
    if not tools:
        return None
    converted = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, FunctionTool):
            raise InvalidRequestError(f"tools[{index}] is a {tool.type!r} tool: only function tools are supported "
                                      "(this server runs no built-in tools)", param="tools")
        function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
        converted.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
    return converted


def chat_tool_choice(choice: ToolChoiceParam | None) -> Any:
    """``{"type": "function", "name": ...}`` is chat's ``{"type": "function", "function": {"name": ...}}``."""
    if isinstance(choice, FunctionToolChoice):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def text_constraint(text: TextConfig | None, structured_outputs: dict[str, Any] | None = None) -> Constraint | None:
    """``text.format``: ``json_schema`` holds the text to its schema, ``json_object`` to any JSON object;
    or vLLM's ``structured_outputs`` extra (asking for both is a 400)."""
    format_ = text.format if text is not None else None
    if structured_outputs is not None:
        if isinstance(format_, TextFormatJSONSchema | TextFormatJSONObject):
            raise InvalidRequestError("give text.format or structured_outputs, not both", param="structured_outputs")
        return request_constraint(structured_outputs)
    if isinstance(format_, TextFormatJSONSchema):
        return Constraint(StructuredOutputsParams(json=format_.json_schema), "text.format.schema")
    if isinstance(format_, TextFormatJSONObject):
        return Constraint(StructuredOutputsParams(json_object=True), "text.format")
    return None
