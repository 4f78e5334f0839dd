"""The Messages API's answers: the message, its content blocks, and errors in Anthropic's shape
(``{"type": "error", "error": {"type", "message"}}``)."""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from tokenmill.outputs import RequestOutput


class TextContent(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseContent(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class ThinkingContent(BaseModel):
    """A reply's reasoning section (``--reasoning-parser``); not signed, so ``signature`` is empty."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


ContentBlock = Annotated[TextContent | ToolUseContent | ThinkingContent, Field(discriminator="type")]

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "timeout"]


class MessagesUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = Field(0, description="prompt tokens found in the prefix cache")
    cache_creation_input_tokens: int = 0


class MessageObject(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[ContentBlock]
    model: str
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: MessagesUsage


class CountTokensResponse(BaseModel):
    input_tokens: int


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def tool_use_id(call_id: str) -> str:
    """Anthropic's ``toolu_`` prefix for the id the tool-call parser gave the call (``call_...``)."""
    return "toolu_" + call_id.removeprefix("call_")


def messages_usage(output: RequestOutput) -> MessagesUsage:
    return MessagesUsage(input_tokens=len(output.prompt_token_ids),
                         output_tokens=sum(len(s.token_ids) for s in output.outputs),
                         cache_read_input_tokens=output.num_cached_tokens)


def stop_reason_of(finish_reason: str | None, stop: int | str | None) -> tuple[StopReason | None, str | None]:
    """Chat's finish reason (after tool-call parsing) as Anthropic's stop reason, and the stop sequence
    that ended the reply, if one did. ``timeout`` is tokenmill's own, as in the Responses API."""
    if finish_reason == "stop" and isinstance(stop, str):
        return "stop_sequence", stop
    reasons: dict[str, StopReason] = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                                      "timeout": "timeout"}
    return reasons.get(finish_reason or ""), None


# -- errors ------------------------------------------------------------------------------------------
class AnthropicErrorInfo(BaseModel):
    type: str = Field(description="invalid_request_error, authentication_error, not_found_error, "
                                  "rate_limit_error, api_error or overloaded_error")
    message: str


class AnthropicError(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorInfo


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error"}


def anthropic_error(status: int, message: str) -> AnthropicError:
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return AnthropicError(error=AnthropicErrorInfo(type=kind, message=message))


MESSAGES_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": AnthropicError, "description": "an invalid request"},
    401: {"model": AnthropicError, "description": "a missing or wrong API key (x-api-key or Authorization: Bearer)"},
    404: {"model": AnthropicError, "description": "an unknown model"},
    429: {"model": AnthropicError, "description": "the queue is full (--max-queued-requests/-tokens); see Retry-After"},
    500: {"model": AnthropicError, "description": "the engine failed the request, or died"},
    503: {"model": AnthropicError, "description": "the server is shutting down"},
}
