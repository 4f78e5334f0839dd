"""``POST /v1/messages`` (Anthropic's Messages API) and ``POST /v1/messages/count_tokens``.

A request is the chat request it stands for (``messages_input``): its turns render through the
chat template and generate through ``chat.generate_chat``, its tool calls are read by the
server's tool-call parser (``ChatTools``; ``tool_choice`` ``any`` and ``tool`` force a call by
grammar), ``output_config.format`` holds the text to a JSON schema and, with
``--reasoning-parser``, the reply's reasoning section becomes a ``thinking`` block before the text
(a constraint then applies to the text after it). Errors on these routes come in Anthropic's shape: the app's handlers
decide the status as for every route, :class:`AnthropicErrorsRoute` reshapes their body.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.responses import Response

from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill_cli.server.chat import chat_prompt_ids_off_loop, generate_chat_off_loop
from tokenmill_cli.server.errors import APIError, exception_body, output_error, streaming_responses
from tokenmill_cli.server.lifecycle import check_admitting
from tokenmill_cli.server.messages_events import BlockEvents, error_event
from tokenmill_cli.server.messages_input import (
    chat_messages,
    chat_tool_choice,
    chat_tools,
    output_constraint,
    rendering,
    tool_input,
)
from tokenmill_cli.server.messages_objects import (
    MESSAGES_ERROR_RESPONSES,
    ContentBlock,
    CountTokensResponse,
    MessageObject,
    MessagesUsage,
    TextContent,
    ThinkingContent,
    ToolUseContent,
    anthropic_error,
    messages_usage,
    new_message_id,
    stop_reason_of,
    tool_use_id,
)
from tokenmill_cli.server.messages_protocol import CountTokensRequest, MessagesRequest
from tokenmill_cli.server.reasoning import ReplyReasoning
from tokenmill_cli.server.response_format import Constraint
from tokenmill_cli.server.responses import ChatResponseMessage
from tokenmill_cli.server.state import ServerState, State
from tokenmill_cli.server.streaming import DeltaTracker, SSEResponse, last_outputs, stop_holdback, until_disconnected
from tokenmill_cli.server.tool_calls import ChatTools, chat_constraint

logger = logging.getLogger(__name__)


class AnthropicErrorsRoute(APIRoute):
    """A route whose errors are in Anthropic's shape (``{"type": "error", "error": {"type", "message"}}``).

    The exception goes to the app's own handler for it (the one every route uses), so the status
    and headers (``Retry-After``) are the same as elsewhere; only the body is reshaped.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def handle_in_anthropic_shape(request: Request) -> Response:
            try:
                return await handle(request)
            except Exception as exc:
                return await _anthropic_answer(request, exc)

        return handle_in_anthropic_shape


async def _anthropic_answer(request: Request, exc: Exception) -> Response:
    handler = next((request.app.exception_handlers[kind] for kind in type(exc).__mro__
                    if kind in request.app.exception_handlers and kind is not Exception), None)
    if handler is None:  # the server's own failure: logged here, as Starlette would have
        logger.exception("internal error in %s", request.url.path, exc_info=exc)
        status, message, headers = 500, exception_body(exc).error.message, {}
    else:
        answer = await handler(request, exc)
        status, headers = answer.status_code, {k: v for k, v in answer.headers.items() if k.lower() == "retry-after"}
        message = _message(answer)
    return JSONResponse(anthropic_error(status, message).model_dump(), status_code=status, headers=headers)


def _message(answer: Response) -> str:
    """The message of an answer in OpenAI's shape."""
    try:
        return str(json.loads(bytes(answer.body))["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return "invalid request"


router = APIRouter(tags=["messages"], route_class=AnthropicErrorsRoute)

_CREATED = streaming_responses(MESSAGES_ERROR_RESPONSES, "an `event:` line with each event's type, `data:` its "
                                                         "JSON, from message_start to message_stop")


@router.post("/v1/messages", response_model=MessageObject, responses=_CREATED,
             dependencies=[Depends(check_admitting)])
async def create_message(body: MessagesRequest, request: Request, state: State) -> Response:
    return await until_disconnected(request, _serve(body, state, request))


@router.post("/v1/messages/count_tokens", response_model=CountTokensResponse, responses=MESSAGES_ERROR_RESPONSES)
async def count_tokens(body: CountTokensRequest, state: State) -> JSONResponse:
    """The prompt's tokens, as ``/v1/messages`` would count them in ``usage.input_tokens``."""
    state.model_name(body.model)
    ids = await chat_prompt_ids_off_loop(state, chat_messages(body.system, body.messages), rendering(body))
    return JSONResponse(CountTokensResponse(input_tokens=len(ids)).model_dump())


@dataclass
class _Plan:
    id: str
    model: str
    tools: ChatTools
    reasoning: ReplyReasoning
    params: SamplingParams


async def _serve(body: MessagesRequest, state: ServerState, request: Request) -> Response:
    model = state.model_name(body.model)
    tool_choice, parallel = chat_tool_choice(body.tool_choice)
    tools = ChatTools.of_request(chat_tools(body.tools), tool_choice, parallel, state.settings.tool_call_parser,
                                 state.settings.enable_auto_tool_choice, state.tokenizer)
    reasoning = ReplyReasoning.of_server(state.settings.reasoning_parser, state.tokenizer)
    constraint = reasoning.constrain(chat_constraint(tools, output_constraint(body.output_config)))
    plan = _Plan(new_message_id(), model, tools, reasoning, _sampling_params(body, constraint))
    merged = await generate_chat_off_loop(state, chat_messages(body.system, body.messages), rendering(body),
                                          plan.params, constraint, plan.id, body.priority, body.timeout,
                                          lora_request=state.lora_request(body.model))
    if body.stream:
        first = await anext(merged)  # input errors surface here, before the 200
        return SSEResponse(request, _Stream(plan).events(first[1], merged), on_close=merged.aclose)
    (final,) = await last_outputs(merged, 1)
    if (error := output_error(final)) is not None:
        raise error
    sample = final.outputs[0]
    thought, content = reasoning.split(sample.text)
    finish_reason = sample.finish_reason
    message = ChatResponseMessage()
    if content is not None:  # None: all reasoning (cut off while thinking), no content to read calls from
        message, finish_reason = tools.reply(content, finish_reason)
    stop_reason, stop_sequence = stop_reason_of(finish_reason, sample.stop_reason)
    answer = MessageObject(id=plan.id, content=_blocks(message, thought), model=model, stop_reason=stop_reason,
                           stop_sequence=stop_sequence, usage=messages_usage(final))
    return JSONResponse(answer.model_dump())


def _sampling_params(body: MessagesRequest, constraint: Constraint | None) -> SamplingParams:
    return SamplingParams(temperature=1.0 if body.temperature is None else body.temperature,
                          top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
                          max_tokens=body.max_tokens, stop=body.stop_sequences,
                          structured_outputs=constraint.params if constraint else None)


def _blocks(message: ChatResponseMessage, thought: str | None) -> list[ContentBlock]:
    """A whole reply's blocks: its reasoning (where the parser found some), its text (if any), its calls."""
    blocks: list[ContentBlock] = []
    if thought is not None:
        blocks.append(ThinkingContent(thinking=thought))
    if message.content:
        blocks.append(TextContent(text=message.content))
    for call in message.tool_calls or []:
        blocks.append(ToolUseContent(id=tool_use_id(call.id), name=call.function.name,
                                     input=tool_input(call.function.arguments)))
    return blocks


@dataclass
class _Stream:
    """``message_start``, the blocks' events as the text comes, then ``message_delta`` and ``message_stop``."""

    plan: _Plan
    blocks: BlockEvents = field(default_factory=BlockEvents)
    finish_reason: str | None = None  # after tool-call parsing: ``tool_calls`` when the reply was calls

    async def events(self, first: RequestOutput, rest: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[str]:
        tracker = DeltaTracker(stop_holdback(self.plan.params.stop))
        start = MessageObject(id=self.plan.id, content=[], model=self.plan.model,
                              usage=MessagesUsage(input_tokens=len(first.prompt_token_ids), output_tokens=0,
                                                  cache_read_input_tokens=first.num_cached_tokens))
        for event in self.blocks.start(start):
            yield event
        latest = first
        try:
            for event in self._advance(first, tracker):
                yield event
            async for _, latest in rest:
                for event in self._advance(latest, tracker):
                    yield event
            stop_reason, stop_sequence = stop_reason_of(self.finish_reason, latest.outputs[0].stop_reason)
            for event in self.blocks.close(stop_reason, stop_sequence, messages_usage(latest)):
                yield event
        except Exception as exc:  # the 200 is sent: report in-band, as Anthropic's streams do
            info = exception_body(exc).error
            status = exc.status if isinstance(exc, APIError) else 400 if info.type == "invalid_request_error" else 500
            yield error_event(anthropic_error(status, info.message))

    def _advance(self, output: RequestOutput, tracker: DeltaTracker) -> list[str]:
        if (error := output_error(output)) is not None:
            raise error
        delta = tracker.advance(output.outputs[0])
        if delta is None:
            return []
        thought, content = self.plan.reasoning.delta(0, delta.text, delta.finish_reason is not None)
        written = self.blocks.thinking(thought) if thought else []
        message, self.finish_reason = self.plan.tools.delta(0, content, delta.finish_reason)
        written += self.blocks.text(message.content) if message.content else []
        for piece in message.tool_calls or []:
            written += self.blocks.call(piece)
        return written
