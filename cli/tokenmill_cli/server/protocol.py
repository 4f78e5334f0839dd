"""Request bodies, with OpenAI's field names (plus vLLM's sampling extras).

Unknown fields are ignored, as OpenAI's own server does, so a newer client
keeps working. Ranges OpenAI documents are checked here (a 400 naming the
field); the rest is checked by ``SamplingParams``. Cross-field checks raise
``InvalidRequestError`` so the 400 names the field even though pydantic
reports them on the whole body.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, WithJsonSchema, model_validator

from tokenmill.errors import InvalidRequestError
from tokenmill.kv_transfer.params import KVTransferParams
from tokenmill_cli.server.openapi import TOKEN_ID_KEYS_MARKER, TOKEN_ID_MARKER

# A token id: the schema's maximum (the vocabulary's last id) is written in when the app is built
# (``openapi``); the route checks it, as only the engine knows the vocabulary.
TokenId = Annotated[int, Field(ge=0, json_schema_extra={TOKEN_ID_MARKER: True})]
_Text = Annotated[str, Field(min_length=1)]
_TokenIds = Annotated[list[TokenId], Field(min_length=1)]
# A completion prompt: text, a batch of texts, token ids, or a batch of token id lists; none empty.
Prompt = _Text | Annotated[list[_Text], Field(min_length=1)] | _TokenIds | Annotated[list[_TokenIds], Field(min_length=1)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    model: str | None = Field(None, description="a served model name; omitted: the first one")

    @model_validator(mode="before")
    @classmethod
    def _check_unicode(cls, data: Any) -> Any:
        """JSON may escape a lone surrogate (``"\\ud800"``); no tokenizer can encode one."""
        if isinstance(data, dict):
            for key, value in data.items():
                if not _encodable(value):
                    raise InvalidRequestError(f"{key} holds text that is not valid Unicode (a lone surrogate)",
                                              param=str(key))
        return data


def _encodable(value: Any) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, dict):
        return all(_encodable(k) and _encodable(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_encodable(v) for v in value)
    return True


class StreamOptions(BaseModel):
    include_usage: bool = Field(False, description="send a last chunk with token counts")


# stream_options only with stream: true (the validator of SamplingFields)
_STREAM_OPTIONS_NEED_STREAM: dict[str, Any] = {
    "if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}}}


class SamplingFields(_Request):
    """The sampling and stopping fields completions and chat share."""

    model_config = ConfigDict(json_schema_extra={"allOf": [_STREAM_OPTIONS_NEED_STREAM]})

    temperature: float | None = Field(None, ge=0, le=2, description="0 is greedy; default 1")
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=128, description="samples per prompt")
    stop: str | list[str] | None = Field(None, description="up to 4 strings that end the text (not included)")
    # int64, as OpenAI documents it (and as torch's generators take it); the schema advertises the
    # range a JSON number holds exactly, which every client can send (a subset: it stays true)
    seed: Annotated[int | None, WithJsonSchema({"anyOf": [{"type": "integer", "minimum": -(2**53), "maximum": 2**53},
                                                          {"type": "null"}],
                                                "description": "the same seed gives the same text (any int64)"})] = \
        Field(None, ge=-(2**63), lt=2**63)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, description="token id (as a string) -> bias in [-100, 100]",
        json_schema_extra={TOKEN_ID_KEYS_MARKER: True})
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras
    top_k: int = Field(0, ge=-1, description="0 or -1 disables")
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    min_tokens: int = Field(0, ge=0, description="at most max_tokens (a 400 otherwise)")
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # no upper bound: an id the model never samples never stops it (the engine accepts it, so the schema does)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    priority: int = Field(0, description="lower runs first under --scheduling-policy priority")
    structured_outputs: dict[str, Any] | None = Field(
        None, description="vLLM's constraint extra: one of json (a schema), json_object, regex, choice, grammar "
                          "(EBNF), structural_tag; with disable_any_whitespace")
    timeout: float | None = Field(None, gt=0, allow_inf_nan=False,
                                  description="seconds after which the request ends with finish_reason 'timeout', "
                                              "keeping what it generated (default: --request-timeout)")
    kv_transfer_params: KVTransferParams | None = Field(
        None, description="vLLM's disaggregated prefill/decode extra, for the KV connector (ignored without one): "
                          "{'do_remote_decode': true} to a prefill server, whose answer's kv_transfer_params go "
                          "to the decode server")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @model_validator(mode="after")
    def _check_stream_options(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", param="stream_options")
        return self


class CompletionRequest(SamplingFields):
    prompt: Prompt = Field(description="text, texts, token ids or lists of token ids")
    max_tokens: int | None = Field(16, ge=0, description="most tokens to generate; null: up to the context; "
                                                         "0 (with echo): score the prompt, generate nothing")
    logprobs: int | None = Field(None, ge=0, le=20, description="logprobs of the chosen and this many likeliest tokens")
    echo: bool = Field(False, description="return the prompt before the completion")
    suffix: Annotated[str | None, WithJsonSchema({"anyOf": [{"type": "string", "maxLength": 0}, {"type": "null"}],
                                                  "description": "not supported (insertion): only null or empty"})] \
        = None
    prompt_logprobs: int | None = Field(None, ge=0, le=20, description="vLLM's extra: each prompt token's logprob "
                                                                       "and this many likeliest, in the choice's "
                                                                       "prompt_logprobs")

    model_config = ConfigDict(json_schema_extra={"allOf": [
        # max_tokens 0 returns nothing but the prompt: it needs echo (what the validator below says)
        {"if": {"required": ["max_tokens"], "properties": {"max_tokens": {"const": 0}}},
         "then": {"required": ["echo"], "properties": {"echo": {"const": True}}}},
        _STREAM_OPTIONS_NEED_STREAM]})

    @model_validator(mode="after")
    def _check_suffix(self) -> CompletionRequest:
        if self.suffix:  # refused rather than ignored: the answer would silently not be what was asked
            raise InvalidRequestError("suffix (text insertion) is not supported", param="suffix")
        if self.max_tokens == 0 and not self.echo:  # vLLM refuses it too: the answer would be empty
            raise InvalidRequestError("max_tokens 0 generates nothing: it is only allowed with echo (to score the "
                                      "prompt, with logprobs)", param="max_tokens")
        return self


class ImageURL(BaseModel):
    url: str = Field(description="a data: URL (base64), an http(s) URL (fetched under --media-fetch-timeout, "
                                 "--max-media-bytes, --allowed-media-domains) or a file:// path under "
                                 "--allowed-local-media-path")
    detail: str | None = None


class TextPart(BaseModel):
    """A text part of a message's content."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text"]
    text: str


class ImagePart(BaseModel):
    """An image part, for a multimodal model (a text model answers 400)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["image_url"]
    image_url: ImageURL


class VideoURL(BaseModel):
    url: str = Field(description="a video file (mp4, webm, ...) as a data: URL (base64), an http(s) URL or a "
                                 "file:// path under --allowed-local-media-path")


class VideoPart(BaseModel):
    """A video part, for a model that takes videos (Qwen2-VL); decoded and sampled by its processor."""

    model_config = ConfigDict(extra="allow")

    type: Literal["video_url"]
    video_url: VideoURL


ContentPart = Annotated[TextPart | ImagePart | VideoPart, Field(discriminator="type")]
Content = str | list[ContentPart]


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str | None = None

    def for_template(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        tool_calls = getattr(self, "tool_calls", None)
        if tool_calls:
            message["tool_calls"] = [_template_tool_call(call) for call in tool_calls]
            message.setdefault("content", "")  # a template may concatenate it: None would not render
        return message


class SystemMessage(_Message):
    role: Literal["system"]
    content: Content


class UserMessage(_Message):
    role: Literal["user"]
    content: Content


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ToolMessage(_Message):
    role: Literal["tool"]
    content: Content
    tool_call_id: str = Field(min_length=1, description="the id of the call this message answers")


def _role(value: Any) -> str | None:
    role = value.get("role") if isinstance(value, dict) else getattr(value, "role", None)
    return role if isinstance(role, str) else None


# discriminated by role: the schema says what each role needs (a tool message: tool_call_id and content)
ChatMessage = Annotated[
    Annotated[SystemMessage, Tag("system")] | Annotated[UserMessage, Tag("user")]
    | Annotated[AssistantMessage, Tag("assistant")] | Annotated[ToolMessage, Tag("tool")],
    Discriminator(_role, custom_error_type="invalid_role",
                  custom_error_message="role must be one of system, user, assistant, tool")]

_CHAT_MESSAGE: TypeAdapter[Any] = TypeAdapter(ChatMessage)


def chat_message(data: dict[str, Any]) -> SystemMessage | UserMessage | AssistantMessage | ToolMessage:
    """One message from its JSON form (``ChatMessage`` is a union, not a class to call)."""
    return _CHAT_MESSAGE.validate_python(data)  # type: ignore[no-any-return]


def _template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """Chat templates write a call's arguments as an object (``arguments | tojson``); OpenAI
    sends them as JSON text, so parse them, as vLLM does, or they would be quoted twice."""
    function = call.get("function")
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            arguments = json.loads(function["arguments"])
        except json.JSONDecodeError:
            return call
        return {**call, "function": {**function, "arguments": arguments}}
    return call


class ChatRendering(BaseModel):
    """How messages become a prompt; shared by chat and /tokenize."""

    model_config = ConfigDict(json_schema_extra={"allOf": [
        # continuing the last message opens no new turn (what render_chat checks)
        {"if": {"required": ["continue_final_message", "add_generation_prompt"],
                "properties": {"continue_final_message": {"const": True}}},
         "then": {"properties": {"add_generation_prompt": {"const": False}}}}]})

    add_generation_prompt: bool = Field(True, description="end the prompt with the assistant turn's opening")
    continue_final_message: bool = Field(False, description="let the model continue the last (assistant) message")
    chat_template: str | None = Field(None, description="a Jinja template for this request only")
    tools: list[dict[str, Any]] | None = Field(None, description="tool definitions, handed to the chat template")


class ChatCompletionRequest(SamplingFields, ChatRendering):
    model_config = ConfigDict(json_schema_extra={"allOf": [
        _STREAM_OPTIONS_NEED_STREAM, *ChatRendering.model_config["json_schema_extra"]["allOf"],  # type: ignore
        # top_logprobs only with logprobs: true (the validator below)
        {"if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
         "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}}]})

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="deprecated by OpenAI for max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    prompt_logprobs: int | None = Field(None, ge=0, le=20, description="vLLM's extra: each prompt token's logprob "
                                                                       "and this many likeliest, in the response's "
                                                                       "prompt_logprobs")
    tool_choice: Any = Field(None, description='"none", "auto" (the default with tools), "required" or '
                                                '{"type": "function", "function": {"name": ...}}')
    parallel_tool_calls: bool = Field(True, description="with a forced tool choice, allow more than one call")
    # validated by response_format.py (its 400s name the sub-field); the schema documents the three forms
    response_format: Annotated[dict[str, Any] | None, WithJsonSchema({"anyOf": [
        {"type": "object", "properties": {"type": {"enum": ["text", "json_object"]}}, "required": ["type"]},
        {"type": "object", "properties": {"type": {"const": "json_schema"}, "json_schema": {
            "type": "object", "properties": {"name": {"type": "string"}, "schema": {"type": "object"},
                                             "strict": {"type": ["boolean", "null"]}},
            "required": ["name"]}}, "required": ["type", "json_schema"]},
        {"type": "null"}],
        "description": "text, json_object, or json_schema ({'json_schema': {'name', 'schema'}})"})] = None

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs set to true", param="top_logprobs")
        return self


class EmbeddingRequest(_Request):
    input: Prompt = Field(description="text, texts, token ids or lists of token ids")
    encoding_format: Literal["float", "base64"] = "float"
    # Only a Matryoshka model takes it (any other answers 400), so the schema offers none.
    dimensions: Annotated[int | None, WithJsonSchema({"type": "null", "description": "truncate the embeddings "
                                                      "to this many dimensions: Matryoshka models only"})] = None
    user: str | None = None
    pooling: Literal["last", "mean", "cls"] | None = Field(
        None, description="last token's hidden state, the first (cls), or the mean of all; default: the model's")
    truncate_prompt_tokens: Annotated[int | None, WithJsonSchema({
        "anyOf": [{"type": "integer", "minimum": 1}, {"const": -1}, {"type": "null"}],
        "description": "keep at most this many tokens of each input (-1: the model's maximum)"})] = None


class TokenizeCompletionRequest(_Request):
    prompt: str = Field(description="the text to tokenize")
    add_special_tokens: bool = Field(True, description="add the tokenizer's BOS/EOS")


class TokenizeChatRequest(_Request, ChatRendering):
    messages: list[ChatMessage] = Field(min_length=1, description="rendered as chat would render them")


# one of the two, as vLLM's; a body with neither is a 400
TokenizeRequest = TokenizeChatRequest | TokenizeCompletionRequest


class DetokenizeRequest(_Request):
    tokens: list[TokenId]
