"""Response bodies, shaped as OpenAI's (and vLLM's for the endpoints OpenAI lacks)."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tokenmill.outputs import RequestOutput

_KV_TRANSFER_PARAMS = ("the KV connector's answer to a request's kv_transfer_params (vLLM's): a prefill server's "
                       "says where a decode server finds the prompt's KV; in a stream, on the last chunk")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int


def usage_of(outputs: list[RequestOutput]) -> Usage:
    """Token counts over finished (or latest) outputs, every sample counted."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(s.token_ids) for o in outputs for s in o.outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


# -- completions ---------------------------------------------------------------
class CompletionLogprobs(BaseModel):
    """The legacy completions layout: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's ``prompt_logprobs`` entry for one candidate token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# per prompt position (None for the first): token id (as a string) -> its logprob
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: PromptLogprobs | None = Field(None, description="with the prompt_logprobs extra (vLLM's)")
    finish_reason: str | None = None
    stop_reason: int | str | None = Field(None, description="the stop string or token id that ended the text")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = Field(default=None, description=_KV_TRANSFER_PARAMS)


# -- chat ------------------------------------------------------------------------
class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="the arguments, as JSON text")


class ChatToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


_REASONING = "the reasoning section of a reasoning model's reply (servers started with --reasoning-parser)"
_REASONING_ALIAS = "the same text as reasoning_content: vLLM's newer name for it"


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = Field(default=None, description=_REASONING)
    reasoning: str | None = Field(default=None, description=_REASONING_ALIAS)
    tool_calls: list[ChatToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = Field(None, description="with the prompt_logprobs extra (vLLM's)")
    kv_transfer_params: dict[str, Any] | None = Field(default=None, description=_KV_TRANSFER_PARAMS)


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of call ``index``: its id, type and name come once, in its first piece."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = Field(default=None, description=_REASONING)
    reasoning: str | None = Field(default=None, description=_REASONING_ALIAS)
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = Field(default=None, description=_KV_TRANSFER_PARAMS)


# -- embeddings ------------------------------------------------------------------
class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(description="floats, or base64 of little-endian float32")


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: Usage


# -- models, tokenizer, status ---------------------------------------------------------
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "tokenmill"
    root: str
    max_model_len: int
    parent: str | None = Field(default=None, description="a LoRA adapter's base model")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfoResponse(BaseModel):
    """vLLM's: ``tokenizer_config.json`` as the server's tokenizer has it (any other keys too)."""

    model_config = ConfigDict(extra="allow")

    tokenizer_class: str
    chat_template: str | None = None


class StatusResponse(BaseModel):
    status: Literal["ok", "ready"] = Field(description="/health: ok; /ready: ready")


class VersionResponse(BaseModel):
    version: str


class EngineStats(BaseModel):
    running: int = Field(description="requests holding KV blocks and stepping")
    waiting: int = Field(description="requests queued (new or preempted)")
    unfinished: int = Field(description="requests the front end still tracks (samples counted once)")
    kv_blocks_free: int
    kv_blocks_total: int
    client_disconnects: int = Field(description="requests ended early because their client went away")
    in_flight: int = Field(0, description="engine requests with an open output stream")
    queued: int = Field(0, description="requests admitted and waiting for their first token (admission control)")
    queued_tokens: int = Field(0, description="their prompt tokens")
    deadlines: int = Field(0, description="requests with a pending timeout")
    seconds_since_heartbeat: float = Field(0.0, description="since the engine loop last went round")
    draining: bool = Field(False, description="shutting down: no request is admitted")
