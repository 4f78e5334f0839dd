"""``POST /v1/chat/completions``: messages through the chat template, a reply out."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from tokenmill.config import EngineConfig
from tokenmill.entrypoints.chat import render_chat
from tokenmill.errors import InvalidRequestError
from tokenmill.lora import LoRARequest
from tokenmill.multimodal.chat_media import media_placeholders, names_remote_media, take_media
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill_cli.server.errors import STREAMING_RESPONSES, APIError, exception_body, output_error
from tokenmill_cli.server.lifecycle import check_admitting
from tokenmill_cli.server.logprobs import chat_logprobs, padded_logprobs, prompt_logprobs
from tokenmill_cli.server.protocol import ChatCompletionRequest, ChatMessage, ChatRendering
from tokenmill_cli.server.reasoning import ReplyReasoning
from tokenmill_cli.server.response_format import Constraint, naming_errors, request_constraint
from tokenmill_cli.server.responses import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    new_id,
    usage_of,
)
from tokenmill_cli.server.sampling import chat_sampling_params
from tokenmill_cli.server.state import ServerState, State
from tokenmill_cli.server.streaming import (
    DONE,
    DeltaTracker,
    SSEResponse,
    last_outputs,
    merge_streams,
    sse_event,
    stop_holdback,
    until_disconnected,
)
from tokenmill_cli.server.tool_calls import ChatTools, chat_constraint

router = APIRouter(tags=["chat"])


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=STREAMING_RESPONSES,
             dependencies=[Depends(check_admitting)])
async def create_chat_completion(body: ChatCompletionRequest, request: Request, state: State) -> Response:
    return await until_disconnected(request, _serve(body, state, request))


def chat_prompt_ids(state: ServerState, messages: Sequence[ChatMessage], rendering: ChatRendering) -> list[int]:
    """Render the messages with the request's, the server's or the model's template, and tokenize."""
    text, _ = chat_prompt(state, messages, rendering)
    # the template writes the special tokens (BOS) itself: do not add them twice
    return list(state.tokenizer.encode(text, add_special_tokens=False))


async def chat_prompt_ids_off_loop(state: ServerState, messages: Sequence[ChatMessage], rendering: ChatRendering,
                                   ) -> list[int]:
    """:func:`chat_prompt_ids` (for /tokenize and /v1/messages/count_tokens), on a worker thread when a message names an http(s)
    image or video, as :func:`generate_chat_off_loop` does: the download never holds the event loop."""
    if not any(names_remote_media(m.for_template()) for m in messages):
        return chat_prompt_ids(state, messages, rendering)
    return await asyncio.to_thread(chat_prompt_ids, state, messages, rendering)


def chat_prompt(state: ServerState, messages: Sequence[ChatMessage], rendering: ChatRendering,
                param: str = "messages") -> tuple[str, dict[str, list[Any]]]:
    """The rendered prompt text and its items by modality (images, videos' bytes), each part
    rendered as the model's placeholder (``tokenmill.multimodal.chat_media``); a bad image is blamed on ``param``."""
    add_generation_prompt = rendering.add_generation_prompt
    if rendering.continue_final_message and "add_generation_prompt" not in rendering.model_fields_set:
        add_generation_prompt = False  # continuing the last message: no new turn, unless asked for explicitly
    processor = getattr(getattr(state.engine, "engine", None), "input_processor", None)
    placeholders = media_placeholders(getattr(processor, "multimodal", None))
    config = getattr(state.engine, "config", None)
    media_root = getattr(config, "allowed_local_media_path", None)
    fetch_policy = config.media_fetch_policy() if isinstance(config, EngineConfig) else None
    try:  # http(s) media are fetched here: callers run this off the event loop (generate_chat_off_loop)
        dicts, media = take_media([m.for_template() for m in messages], placeholders, media_root, fetch_policy)
    except InvalidRequestError as exc:
        raise InvalidRequestError(str(exc), param=param) from exc
    text = render_chat(state.tokenizer, dicts, rendering.chat_template or state.settings.chat_template,
                       add_generation_prompt, rendering.continue_final_message, rendering.tools)
    return text, media


def generate_chat(state: ServerState, messages: Sequence[ChatMessage], rendering: ChatRendering,
                  params: SamplingParams, constraint: Constraint | None, request_id: str, priority: int = 0,
                  timeout: float | None = None, param: str = "messages", lora_request: LoRARequest | None = None,
                  ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """The engine's outputs for ``messages`` through the chat template, as one merged stream.

    Chat completions and the Responses API (``responses_api``) both generate through here;
    ``param`` is the request field a prompt too long for the context is blamed on.
    """
    text, media = chat_prompt(state, messages, rendering, param)
    prompt_ids = list(state.tokenizer.encode(text, add_special_tokens=False))  # the template wrote them
    if len(prompt_ids) >= state.engine.max_model_len:
        raise InvalidRequestError(
            f"the {param} take {len(prompt_ids)} tokens, which leaves no room to generate within the model's "
            f"context of {state.engine.max_model_len} tokens (max_model_len)", param=param)
    prompt: dict[str, Any] = ({"prompt": text, "multi_modal_data": {k: v for k, v in media.items() if v},
                               "add_special_tokens": False} if any(media.values()) else {"prompt_token_ids": prompt_ids})
    generation = state.engine.generate(prompt, params, request_id=request_id,
                                       priority=priority, timeout=timeout, lora_request=lora_request)
    return merge_streams([naming_errors(generation, constraint)])


async def generate_chat_off_loop(state: ServerState, messages: Sequence[ChatMessage], rendering: ChatRendering,
                                 params: SamplingParams, constraint: Constraint | None, request_id: str,
                                 priority: int = 0, timeout: float | None = None, param: str = "messages",
                                 lora_request: LoRARequest | None = None,
                                 ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """:func:`generate_chat`, on a worker thread when a message names an http(s) image or video:
    it downloads there (seconds, perhaps), so the event loop streaming other requests' tokens
    never waits on it. Without one it runs in place, as it always has."""
    if not any(names_remote_media(m.for_template()) for m in messages):
        return generate_chat(state, messages, rendering, params, constraint, request_id, priority, timeout, param,
                             lora_request)
    return await asyncio.to_thread(generate_chat, state, messages, rendering, params, constraint, request_id,
                                   priority, timeout, param, lora_request)


async def _serve(body: ChatCompletionRequest, state: ServerState, request: Request) -> Response:
    model = state.model_name(body.model)
    tools = ChatTools.of_request(body.tools, body.tool_choice, body.parallel_tool_calls,
                                 state.settings.tool_call_parser, state.settings.enable_auto_tool_choice,
                                 state.tokenizer)
    reasoning = ReplyReasoning.of_server(state.settings.reasoning_parser, state.tokenizer)
    constraint = reasoning.constrain(chat_constraint(tools, request_constraint(body.structured_outputs,
                                                                               body.response_format)))
    params = chat_sampling_params(body, constraint.params if constraint else None)
    request_id = new_id("chatcmpl")
    merged = await generate_chat_off_loop(state, body.messages, body, params, constraint, request_id, body.priority,
                                          body.timeout, lora_request=state.lora_request(body.model))
    view = _View(body, params, state.tokenizer, tools, reasoning)
    if body.stream:
        first = await anext(merged)  # input errors surface here, before the 200
        stream = _Stream(request_id, model, view)
        return SSEResponse(request, stream.events(first[1], merged), on_close=merged.aclose)
    (final,) = await last_outputs(merged, 1)
    if (error := output_error(final)) is not None:
        raise error
    choices = [ChatChoice(index=s.index, message=message, logprobs=view.logprobs(s, 0, len(s.token_ids)),
                          finish_reason=finish_reason, stop_reason=s.stop_reason)
               for s in final.outputs for message, finish_reason in [view.reply(s.text, s.finish_reason)]]
    response = ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage_of([final]),
                                      prompt_logprobs=_prompt_logprobs(body, state, final),
                                      kv_transfer_params=final.kv_transfer_params)
    return JSONResponse(response.model_dump())


def _prompt_logprobs(body: ChatCompletionRequest, state: ServerState, final: RequestOutput) -> list[Any] | None:
    if body.prompt_logprobs is None:
        return None
    return prompt_logprobs(state.tokenizer, final.prompt_token_ids, final.prompt_logprobs)


@dataclass
class _View:
    body: ChatCompletionRequest
    params: SamplingParams
    tokenizer: Any
    tools: ChatTools
    reasoning: ReplyReasoning

    def reply(self, text: str, finish_reason: str | None) -> tuple[ChatResponseMessage, str | None]:
        """A finished reply's message: its reasoning section split off, the rest read for tool calls."""
        reasoning, content = self.reasoning.split(text)
        if content is None:  # all reasoning (cut off while thinking): no content to read calls from
            message = ChatResponseMessage()
        else:
            message, finish_reason = self.tools.reply(content, finish_reason)
        return message.model_copy(update={"reasoning_content": reasoning, "reasoning": reasoning}), finish_reason

    def delta(self, index: int, text: str, finish_reason: str | None) -> tuple[DeltaMessage, str | None]:
        """The delta of choice ``index`` for its new text: new reasoning, and new content read for calls."""
        reasoning, content = self.reasoning.delta(index, text, finish_reason is not None)
        message, finish_reason = self.tools.delta(index, content, finish_reason)
        if reasoning:
            message = message.model_copy(update={"reasoning_content": reasoning, "reasoning": reasoning})
        return message, finish_reason

    def logprobs(self, sample: CompletionOutput, start: int, end: int) -> ChatLogprobs | None:
        if not self.body.logprobs:
            return None
        entries = padded_logprobs(sample.logprobs, len(sample.token_ids))[start:end]
        return ChatLogprobs(content=chat_logprobs(self.tokenizer, sample.token_ids[start:end], entries,
                                                  self.body.top_logprobs or 0))


@dataclass
class _Stream:
    """The assistant role first, then one chunk per choice per step with new text, then usage."""

    request_id: str
    model: str
    view: _View
    trackers: dict[int, DeltaTracker] = field(default_factory=dict)
    aborted: APIError | None = None  # the server ended the request: said after its last chunk
    params_sent: bool = False  # the KV connector's kv_transfer_params went out (on a finishing chunk)

    async def events(self, first: RequestOutput, rest: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[str]:
        latest = first
        try:
            for index in range(self.view.params.n):
                yield sse_event(self._chunk(ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant",
                                                                                              content=""))))
            for chunk in self._chunks(first):
                yield sse_event(chunk)
            async for _, latest in rest:
                for chunk in self._chunks(latest):
                    yield sse_event(chunk)
            if self.view.body.include_usage:
                yield sse_event(ChatCompletionChunk(id=self.request_id, model=self.model, choices=[],
                                                    usage=usage_of([latest])))
            if self.aborted is not None:
                yield sse_event(exception_body(self.aborted))
        except Exception as exc:  # the 200 is sent: report in-band, as OpenAI's streams do
            yield sse_event(exception_body(exc))
        yield DONE

    def _chunk(self, choice: ChatStreamChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, model=self.model, choices=[choice])

    def _chunks(self, output: RequestOutput) -> list[ChatCompletionChunk]:
        if (error := output_error(output)) is not None:
            if error.code != "request_aborted":
                raise error
            self.aborted = error  # the chunks (finish_reason "abort") still go out first
        chunks = []
        for sample in output.outputs:
            tracker = self.trackers.setdefault(sample.index, DeltaTracker(stop_holdback(self.view.params.stop)))
            delta = tracker.advance(sample)
            if delta is None:
                continue
            message, finish_reason = self.view.delta(sample.index, delta.text, delta.finish_reason)
            logprobs = self.view.logprobs(sample, delta.token_start, delta.token_end)
            if (message.content is None and message.tool_calls is None and message.reasoning_content is None
                    and finish_reason is None and logprobs is None):
                continue  # text a parser holds back: it goes out with a later chunk
            chunk = self._chunk(ChatStreamChoice(index=sample.index, delta=message, logprobs=logprobs,
                                                 finish_reason=finish_reason, stop_reason=delta.stop_reason))
            if finish_reason is not None and output.kv_transfer_params is not None and not self.params_sent:
                chunk.kv_transfer_params, self.params_sent = output.kv_transfer_params, True
            chunks.append(chunk)
        return chunks
