"""The Anthropic Messages API's request body (``POST /v1/messages``), with Anthropic's field names.

``messages`` alternate ``user`` and ``assistant`` turns; content is text or a list of blocks:
``text``, ``tool_use`` (a call the model made, sent back), ``tool_result`` (its result, in a user
turn) and ``thinking`` (an earlier reply's reasoning, sent back and left out of the prompt).
Blocks of a kind a text model cannot read (images, documents, server tools' results) parse as
:class:`OtherBlock`, so the 400 names the kind instead of listing union mismatches; they are
left out of the OpenAPI schema, which lists only what is served.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator
from pydantic.json_schema import SkipJsonSchema

from tokenmill.errors import InvalidRequestError
from tokenmill_cli.server.protocol import _Request


class TextBlockParam(BaseModel):
    model_config = ConfigDict(extra="ignore")  # cache_control, citations: accepted, without effect

    type: Literal["text"]
    text: str


class ToolUseBlockParam(BaseModel):
    """A call the model made (an earlier reply's ``tool_use`` block), sent back in an assistant turn."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any] = Field(description="the call's arguments, an object")


class OtherBlock(BaseModel):
    """A block of another kind (``image``, ``document``, ...): refused when the prompt is built."""

    model_config = ConfigDict(extra="allow")

    type: str


def _result_block_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "text" if kind == "text" else "other"


# Tagged by ``type``, not left to pydantic's smart union: it would take a text block with extra
# keys for an OtherBlock (which keeps the extras and so "fits better") and refuse it.
ResultBlockParam = Annotated[
    Annotated[TextBlockParam, Tag("text")] | SkipJsonSchema[Annotated[OtherBlock, Tag("other")]],
    Discriminator(_result_block_kind),
]
ToolResultContent = str | list[ResultBlockParam]


class ToolResultBlockParam(BaseModel):
    """The result of the call ``tool_use_id``, in a user turn: a ``tool`` message to the chat template."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: ToolResultContent = ""
    is_error: bool | None = Field(None, description="accepted; the result's text is what the model reads")


class ThinkingBlockParam(BaseModel):
    """An earlier reply's reasoning sent back: accepted and left out of the prompt, as chat
    templates drop the reasoning of earlier turns."""

    model_config = ConfigDict(extra="allow")

    type: Literal["thinking", "redacted_thinking"]


_BLOCK_KINDS = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


def _block_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if kind == "redacted_thinking":
        return "thinking"
    return kind if kind in _BLOCK_KINDS else "other"


def _user_block_kind(value: Any) -> str:
    """What a user turn holds: text, tool results (and reasoning sent back, left out); anything else is refused."""
    kind = _block_kind(value)
    return kind if kind in ("text", "tool_result", "thinking") else "other"


def _assistant_block_kind(value: Any) -> str:
    """What an assistant turn holds: text, tool calls and reasoning; anything else is refused."""
    kind = _block_kind(value)
    return kind if kind in ("text", "tool_use", "thinking") else "other"


UserBlockParam = Annotated[
    Annotated[TextBlockParam, Tag("text")] | Annotated[ToolResultBlockParam, Tag("tool_result")]
    | Annotated[ThinkingBlockParam, Tag("thinking")] | SkipJsonSchema[Annotated[OtherBlock, Tag("other")]],
    Discriminator(_user_block_kind),
]
AssistantBlockParam = Annotated[
    Annotated[TextBlockParam, Tag("text")] | Annotated[ToolUseBlockParam, Tag("tool_use")]
    | Annotated[ThinkingBlockParam, Tag("thinking")] | SkipJsonSchema[Annotated[OtherBlock, Tag("other")]],
    Discriminator(_assistant_block_kind),
]


class UserMessageParam(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["user"]
    content: str | list[UserBlockParam]


class AssistantMessageParam(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["assistant"]
    content: str | list[AssistantBlockParam]


# A turn's blocks by its role, so the schema says which blocks each role may hold.
MessageParam = Annotated[UserMessageParam | AssistantMessageParam, Field(discriminator="role")]


class ToolParam(BaseModel):
    """A client tool: the model calls it, the client runs it (this server runs no tools itself)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any] = Field(description="a JSON schema of the call's input")


class ToolChoiceAuto(BaseModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(BaseModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = Field(None, description="true: one call at most")


class ToolChoiceTool(BaseModel):
    type: Literal["tool"]
    name: str = Field(min_length=1)
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(BaseModel):
    type: Literal["none"]


ToolChoiceParam = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone,
                            Field(discriminator="type")]


class JSONOutputFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema", description="the JSON schema the text must follow")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: JSONOutputFormat | None = Field(None, description="structured output: the text follows the schema")
    effort: str | None = Field(None, description="accepted; without effect")


class Metadata(BaseModel):
    model_config = ConfigDict(extra="ignore")

    user_id: str | None = Field(None, description="accepted; not used")


class CountTokensRequest(_Request):
    """What a prompt is made of: the body of ``/v1/messages/count_tokens``, and the start of a
    ``/v1/messages`` request."""

    messages: list[MessageParam] = Field(min_length=1, description="user and assistant turns; a last assistant "
                                                                    "turn is continued (a prefill)")
    system: str | list[TextBlockParam] | None = Field(None, description="a system message before the turns")
    tools: list[ToolParam] | None = Field(None, description="client tools")
    tool_choice: ToolChoiceParam | None = Field(None, description='{"type": "auto"} (the default with tools), '
                                                                  '"any", "tool" (with "name") or "none"')
    thinking: dict[str, Any] | None = Field(None, description="accepted; the model's own reasoning is not "
                                                              "configurable")

    @field_validator("messages", mode="before")
    @classmethod
    def _check_messages(cls, value: Any) -> Any:
        """One readable 400 for an empty list (the schema says it too)."""
        if value == []:
            raise InvalidRequestError("messages must not be empty", param="messages")
        return value


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, description="most tokens to generate (required)")
    temperature: float | None = Field(None, ge=0, le=1, description="0 is greedy; default 1")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=1, description="sample from the k likeliest tokens only")
    stop_sequences: list[str] | None = Field(None, description="strings that end the reply (not included)")
    stream: bool = False
    metadata: Metadata | None = None
    output_config: OutputConfig | None = Field(None, description="format: a JSON schema the text follows")
    # tokenmill's extras, as in chat completions
    priority: int = Field(0, description="lower runs first under --scheduling-policy priority")
    timeout: float | None = Field(None, gt=0, allow_inf_nan=False,
                                  description="seconds after which the reply ends (stop_reason 'timeout'), "
                                              "keeping what it generated (default: --request-timeout)")
