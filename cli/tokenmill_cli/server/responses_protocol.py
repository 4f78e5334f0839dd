"""The Responses API's request body (``POST /v1/responses``), with OpenAI's field names.

``input`` is text or a list of items: messages (``role`` user, system, developer or
assistant; content as text or ``input_text`` / ``output_text`` parts), ``function_call``
items (a call the model made, sent back) and ``function_call_output`` items (its result).
Items and tools of a kind this server cannot serve (built-in tools such as web_search,
images, item references) are parsed as :class:`OtherItem` / :class:`OtherTool` so the 400
can say which kind is not supported instead of a list of union mismatches; they are left out
of the OpenAPI schema (``SkipJsonSchema``), which lists only what is served.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator
from pydantic.json_schema import SkipJsonSchema

from tokenmill.errors import InvalidRequestError
from tokenmill_cli.server.protocol import _Request


class TextPart(BaseModel):
    """A part of a message's content a text model reads."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["input_text", "output_text"]
    text: str


class OtherPart(BaseModel):
    """Another kind of part (``input_image``, ``input_file``, ...): refused when the prompt is built."""

    model_config = ConfigDict(extra="allow")

    type: str


def _part_kind(value: Any) -> str:
    """Text parts by their type, whatever else they carry (a plain union would let ``OtherPart``,
    which keeps extra keys, win for a text part that has some)."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "text" if kind in ("input_text", "output_text") else "other"


Part = Annotated[Annotated[TextPart, Tag("text")] | Annotated[SkipJsonSchema[OtherPart], Tag("other")],
                 Discriminator(_part_kind)]
Content = str | list[Part]


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Content
    id: str | None = None
    status: str | None = None


class FunctionCallItem(BaseModel):
    """A call the model made (from an earlier response's output), sent back as input."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str = Field(description="the arguments, as JSON text")
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(BaseModel):
    """The result of the call ``call_id``: becomes a ``tool`` message in the chat template."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: Content
    id: str | None = None
    status: str | None = None


class ReasoningItem(BaseModel):
    """A reasoning item sent back (clients replay a response's output whole): accepted and left
    out of the prompt, as chat templates drop earlier turns' reasoning."""

    model_config = ConfigDict(extra="allow")

    type: Literal["reasoning"]


class OtherItem(BaseModel):
    """An item of a kind this server does not serve (``item_reference``, ``web_search_call``, ...)."""

    model_config = ConfigDict(extra="allow")

    type: str


def _item_kind(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ("message", "function_call", "function_call_output", "reasoning") else "other"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")]
    | SkipJsonSchema[Annotated[OtherItem, Tag("other")]],
    Discriminator(_item_kind),
]


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    name: str = Field(min_length=1)
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments")
    description: str | None = None
    strict: bool | None = Field(None, description="accepted; a forced call's arguments always follow the schema")


class OtherTool(BaseModel):
    """A built-in tool (web_search, file_search, mcp, ...): refused, this server runs no tools itself."""

    model_config = ConfigDict(extra="allow")

    type: str


Tool = Annotated[
    Annotated[FunctionTool, Tag("function")] | SkipJsonSchema[Annotated[OtherTool, Tag("other")]],
    Discriminator(lambda v: "function" if (v.get("type") if isinstance(v, dict) else getattr(v, "type", None))
                  == "function" else "other"),
]


class FunctionToolChoice(BaseModel):
    type: Literal["function"]
    name: str


ToolChoiceParam = Literal["none", "auto", "required"] | FunctionToolChoice


class TextFormatText(BaseModel):
    type: Literal["text"]


class TextFormatJSONObject(BaseModel):
    type: Literal["json_object"]


class TextFormatJSONSchema(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    type: Literal["json_schema"]
    name: str = Field(min_length=1, max_length=64)
    json_schema: dict[str, Any] = Field(alias="schema", description="the JSON schema the text must follow")
    description: str | None = None
    strict: bool | None = Field(None, description="accepted; the schema is always enforced (a grammar)")


TextFormat = Annotated[TextFormatText | TextFormatJSONObject | TextFormatJSONSchema, Field(discriminator="type")]


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: TextFormat = Field(default_factory=lambda: TextFormatText(type="text"))


class ResponsesRequest(_Request):
    input: Annotated[str, Field(min_length=1)] | Annotated[list[InputItem], Field(min_length=1)] = Field(
        description="text (one user message) or a list of items")
    instructions: str | None = Field(None, description="a system message before the input; not carried over "
                                                       "by previous_response_id")
    max_output_tokens: int | None = Field(None, ge=1, description="most tokens to generate; null: up to the context")
    temperature: float | None = Field(None, ge=0, le=2, description="0 is greedy; default 1")
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[Tool] | None = Field(None, description="function tools only")
    tool_choice: ToolChoiceParam | None = Field(None, description='"none", "auto" (the default with tools), '
                                                                  '"required" or {"type": "function", "name": ...}')
    parallel_tool_calls: bool = Field(True, description="with a forced tool choice, allow more than one call")
    text: TextConfig | None = Field(None, description="format: text, json_object or json_schema")
    stream: bool = False
    store: bool = Field(True, description="keep the response for GET and previous_response_id (in memory, bounded)")
    previous_response_id: str | None = Field(None, description="continue the conversation of a stored response")
    metadata: dict[str, str] | None = Field(None, max_length=16, description="returned as given")
    user: str | None = None
    truncation: Literal["disabled"] | None = Field(None, description='only "disabled": an input too long for the '
                                                                     "context is a 400")
    reasoning: dict[str, Any] | None = Field(None, description="accepted; the model's own reasoning is not configurable")
    include: list[str] | None = Field(None, description="accepted; nothing extra is included")
    # not supported, and typed so that the schema says so: only the values that ask for nothing pass
    background: Literal[False] = Field(False, description="not supported: only false")
    conversation: None = Field(None, description="not supported (use previous_response_id)")
    prompt: None = Field(None, description="not supported (prompt templates)")
    top_logprobs: Literal[0] | None = Field(None, description="not supported: only 0 or null")
    # the extras chat completions has too
    structured_outputs: dict[str, Any] | None = Field(
        None, description="vLLM's constraint extra, as in chat completions (instead of text.format)")
    priority: int = Field(0, description="lower runs first under --scheduling-policy priority")
    timeout: float | None = Field(None, gt=0, allow_inf_nan=False,
                                  description="seconds after which the response ends incomplete (reason "
                                              "'timeout'), keeping what it generated (default: --request-timeout)")

    @field_validator("input", mode="before")
    @classmethod
    def _check_input(cls, value: Any) -> Any:
        """One readable 400 rather than a mismatch per member of the union (the schema says it too)."""
        if value == "" or value == []:
            raise InvalidRequestError("input must not be empty", param="input")
        return value
