"""The Responses API's response body: a ``response`` object whose ``output`` is a list of items
(a ``reasoning`` item where a reasoning parser split one off, an assistant ``message`` with
``output_text`` parts, ``function_call`` items), shaped as OpenAI's.

(``responses.py`` holds the bodies of the other routes; this is the Responses API's.)
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field

from tokenmill.outputs import RequestOutput
from tokenmill_cli.server.responses import now

ItemStatus = Literal["in_progress", "completed", "incomplete"]
ResponseStatus = Literal["in_progress", "completed", "incomplete", "failed"]


def new_item_id(prefix: str) -> str:
    """OpenAI's ids: ``resp_``, ``msg_``, ``fc_`` then hex."""
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str = Field(description="what the function_call_output answering this call names")
    name: str
    arguments: str = Field(description="the arguments, as JSON text")
    status: ItemStatus


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    """The reply's reasoning section, split off by the server's reasoning parser (``--reasoning-parser``):
    its text in one ``reasoning_text`` part; no summary (the model writes none)."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: ItemStatus


OutputItem = OutputReasoning | OutputMessage | OutputFunctionCall


class InputTokensDetails(BaseModel):
    cached_tokens: int = Field(default=0, description="prompt tokens whose KV came from the prefix cache")


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=lambda: InputTokensDetails())
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=lambda: OutputTokensDetails())
    total_tokens: int


def response_usage(output: RequestOutput) -> ResponseUsage:
    prompt, generated = len(output.prompt_token_ids), sum(len(s.token_ids) for s in output.outputs)
    return ResponseUsage(input_tokens=prompt, input_tokens_details=InputTokensDetails(
        cached_tokens=output.num_cached_tokens), output_tokens=generated, total_tokens=prompt + generated)


class IncompleteDetails(BaseModel):
    reason: str = Field(description='"max_output_tokens" (or the context) cut it; "timeout": --request-timeout '
                                    "or the request's own")


class ResponseErrorInfo(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=now)
    completed_at: int | None = None
    status: ResponseStatus
    error: ResponseErrorInfo | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    background: bool = False


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True
