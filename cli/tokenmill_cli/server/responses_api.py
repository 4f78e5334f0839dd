"""``POST /v1/responses`` (OpenAI's Responses API), ``GET`` and ``DELETE /v1/responses/{id}``.

A request is the chat request it stands for (``responses_input``): its messages render
through the chat template and generate through ``chat.generate_chat``, its tool calls are
read by the server's tool-call parser (``ChatTools``) and ``text.format`` constrains it as
``response_format`` does (after the reasoning section, where the server has a reasoning
parser). The reply becomes output items: a ``reasoning`` item where the server's reasoning
parser (``--reasoning-parser``) finds a reasoning section, an assistant message with one
``output_text`` part, then a ``function_call`` item per call. Finished responses are kept
in the bounded in-memory store (``response_store``) unless ``store`` is false.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill_cli.server.chat import generate_chat_off_loop
from tokenmill_cli.server.errors import (
    ERROR_RESPONSES,
    APIError,
    exception_body,
    output_error,
    streaming_responses,
)
from tokenmill_cli.server.lifecycle import check_admitting
from tokenmill_cli.server.protocol import ChatRendering
from tokenmill_cli.server.reasoning import ReplyReasoning
from tokenmill_cli.server.response_format import Constraint
from tokenmill_cli.server.response_store import StoredResponse
from tokenmill_cli.server.responses import ChatResponseMessage, ErrorResponse, now
from tokenmill_cli.server.responses_events import EventWriter, OutputEvents
from tokenmill_cli.server.responses_input import (
    as_input_items,
    chat_messages,
    chat_tool_choice,
    chat_tools,
    input_items,
    text_constraint,
)
from tokenmill_cli.server.responses_objects import (
    DeletedResponse,
    IncompleteDetails,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    ReasoningText,
    ResponseErrorInfo,
    ResponseObject,
    new_item_id,
    response_usage,
)
from tokenmill_cli.server.responses_protocol import InputItem, ResponsesRequest
from tokenmill_cli.server.state import ServerState, State
from tokenmill_cli.server.streaming import DeltaTracker, SSEResponse, last_outputs, until_disconnected
from tokenmill_cli.server.tool_calls import ChatTools, chat_constraint

router = APIRouter(tags=["responses"])

_NOT_FOUND: dict[int | str, dict[str, Any]] = {
    401: ERROR_RESPONSES[401], 404: {"model": ErrorResponse, "description": "no stored response has this id"}}
_CREATED = streaming_responses(ERROR_RESPONSES, "an `event:` line with each event's type, `data:` its JSON, "
                                                "ending with response.completed, .incomplete or .failed")


@router.post("/v1/responses", response_model=ResponseObject, responses=_CREATED,
             dependencies=[Depends(check_admitting)])
async def create_response(body: ResponsesRequest, request: Request, state: State) -> Response:
    return await until_disconnected(request, _serve(body, state, request))


@router.get("/v1/responses/{response_id}", response_model=ResponseObject, responses=_NOT_FOUND)
async def retrieve_response(response_id: str, state: State) -> JSONResponse:
    return JSONResponse(_stored(state, response_id).response)


@router.delete("/v1/responses/{response_id}", response_model=DeletedResponse, responses=_NOT_FOUND)
async def delete_response(response_id: str, state: State) -> JSONResponse:
    if not state.response_store.delete(response_id):
        raise _not_found(response_id)
    return JSONResponse(DeletedResponse(id=response_id).model_dump())


def _stored(state: ServerState, response_id: str) -> StoredResponse:
    entry = state.response_store.get(response_id)
    if entry is None:
        raise _not_found(response_id)
    return entry


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", code="not_found")


def _history(state: ServerState, previous_response_id: str | None) -> tuple[InputItem, ...]:
    """The conversation a response continues (as OpenAI answers a missing one: a 400 naming the field)."""
    if previous_response_id is None:
        return ()
    entry = state.response_store.get(previous_response_id)
    if entry is None:
        raise APIError(400, f"Previous response with id '{previous_response_id}' not found.",
                       param="previous_response_id", code="previous_response_not_found")
    return entry.conversation


@dataclass
class _Plan:
    """One request, resolved: what it answers with and what it continues."""

    response: ResponseObject  # the response's fields as the request set them, before any output
    conversation: tuple[InputItem, ...]  # the previous response's conversation, then this input
    tools: ChatTools
    reasoning: ReplyReasoning
    store: bool


async def _serve(body: ResponsesRequest, state: ServerState, request: Request) -> Response:
    model = state.model_name(body.model)
    conversation = (*_history(state, body.previous_response_id), *input_items(body.input))
    tools_param = chat_tools(body.tools)
    tools = ChatTools.of_request(tools_param, chat_tool_choice(body.tool_choice), body.parallel_tool_calls,
                                 state.settings.tool_call_parser, state.settings.enable_auto_tool_choice,
                                 state.tokenizer)
    reasoning = ReplyReasoning.of_server(state.settings.reasoning_parser, state.tokenizer)
    constraint = reasoning.constrain(chat_constraint(tools, text_constraint(body.text, body.structured_outputs)))
    params = _sampling_params(body, constraint)
    store = body.store and state.response_store.capacity > 0
    plan = _Plan(_skeleton(body, model, tools, store), conversation, tools, reasoning, store)
    rendering = ChatRendering(add_generation_prompt=True, continue_final_message=False, chat_template=None,
                              tools=tools_param)
    merged = await generate_chat_off_loop(state, chat_messages(body.instructions, conversation), rendering, params,
                                          constraint, plan.response.id, body.priority, body.timeout, param="input",
                                          lora_request=state.lora_request(body.model))
    if body.stream:
        first = await anext(merged)  # input errors surface here, before the 200
        stream = _Stream(plan, state, EventWriter())
        return SSEResponse(request, stream.events(first[1], merged), on_close=merged.aclose)
    (final,) = await last_outputs(merged, 1)
    if (error := output_error(final)) is not None:
        raise error
    sample = final.outputs[0]
    thought, content = reasoning.split(sample.text)
    finish_reason = sample.finish_reason
    if content is None:  # all reasoning (cut off while thinking): no content to read calls from
        message = ChatResponseMessage()
    else:
        message, finish_reason = tools.reply(content, finish_reason)
    response = _finished(plan, _output_items(message, thought), final, finish_reason)
    _keep(state, plan, response)
    return JSONResponse(response.model_dump())


def _sampling_params(body: ResponsesRequest, constraint: Constraint | None) -> SamplingParams:
    return SamplingParams(temperature=1.0 if body.temperature is None else body.temperature,
                          top_p=1.0 if body.top_p is None else body.top_p, max_tokens=body.max_output_tokens,
                          structured_outputs=constraint.params if constraint else None)


def _skeleton(body: ResponsesRequest, model: str, tools: ChatTools, store: bool) -> ResponseObject:
    """The response before it has output: what ``response.created`` shows."""
    text_format = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text else {"type": "text"}
    tool_choice = body.tool_choice if body.tool_choice is not None else tools.choice.mode
    return ResponseObject(
        id=new_item_id("resp"), status="in_progress", instructions=body.instructions,
        max_output_tokens=body.max_output_tokens, model=model, parallel_tool_calls=body.parallel_tool_calls,
        previous_response_id=body.previous_response_id, store=store,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, text={"format": text_format},
        tool_choice=tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump(),
        tools=[tool.model_dump(exclude_none=True) for tool in body.tools or []], user=body.user,
        metadata=body.metadata or {})


def _output_items(message: ChatResponseMessage, reasoning: str | None) -> list[OutputItem]:
    """A whole reply's items: its reasoning section (where the reasoning parser found one), its
    text as a message (kept even when empty, unless the reply is only calls), then its calls."""
    items: list[OutputItem] = []
    if reasoning is not None:
        items.append(OutputReasoning(id=new_item_id("rs"), status="completed", content=[ReasoningText(text=reasoning)]))
    if message.content or not message.tool_calls:
        items.append(OutputMessage(id=new_item_id("msg"), status="completed",
                                   content=[OutputText(text=message.content or "")]))
    for call in message.tool_calls or []:
        items.append(OutputFunctionCall(id=new_item_id("fc"), call_id=call.id, name=call.function.name,
                                        arguments=call.function.arguments, status="completed"))
    return items


def _incomplete_reason(finish_reason: str | None) -> str | None:
    """``length``: max_output_tokens (or the context) ran out; ``timeout``: the request's time did."""
    return {"length": "max_output_tokens", "timeout": "timeout"}.get(finish_reason or "")


def _finished(plan: _Plan, output: list[OutputItem], final: RequestOutput, finish_reason: str | None,
              ) -> ResponseObject:
    reason = _incomplete_reason(finish_reason)
    if reason is not None and output:
        output[-1].status = "incomplete"  # the item being written when the reply was cut
    return plan.response.model_copy(update={
        "status": "completed" if reason is None else "incomplete", "completed_at": now(), "output": output,
        "incomplete_details": IncompleteDetails(reason=reason) if reason else None, "usage": response_usage(final)})


def _keep(state: ServerState, plan: _Plan, response: ResponseObject) -> None:
    if plan.store:
        state.response_store.put(response.id, StoredResponse(
            response.model_dump(), (*plan.conversation, *as_input_items(response.output))))


@dataclass
class _Stream:
    """``response.created`` and ``response.in_progress``, the output items' events as the text
    comes, then ``response.completed`` (or ``.incomplete``, ``.failed``) with the whole response."""

    plan: _Plan
    state: ServerState
    writer: EventWriter

    async def events(self, first: RequestOutput, rest: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[str]:
        output = OutputEvents(self.writer)
        tracker = DeltaTracker()  # no stop strings: nothing to hold back
        latest = first
        yield self.writer.event("response.created", response=self.plan.response)
        yield self.writer.event("response.in_progress", response=self.plan.response)
        try:
            for event in self._advance(first, tracker, output):
                yield event
            async for _, latest in rest:
                for event in self._advance(latest, tracker, output):
                    yield event
            finish_reason = latest.outputs[0].finish_reason
            reason = _incomplete_reason(finish_reason)
            for event in output.close("completed" if reason is None else "incomplete"):
                yield event
            response = _finished(self.plan, output.items, latest, finish_reason)
            _keep(self.state, self.plan, response)
            yield self.writer.event(f"response.{response.status}", response=response)
        except Exception as exc:  # the 200 is sent: report in-band, as OpenAI's streams do
            info = exception_body(exc).error
            failed = self.plan.response.model_copy(update={
                "status": "failed", "output": output.items,
                "error": ResponseErrorInfo(code=str(info.code or info.type), message=info.message)})
            yield self.writer.event("response.failed", response=failed)

    def _advance(self, output: RequestOutput, tracker: DeltaTracker, events: OutputEvents) -> list[str]:
        if (error := output_error(output)) is not None:
            raise error
        delta = tracker.advance(output.outputs[0])
        if delta is None:
            return []
        thought, content = self.plan.reasoning.delta(0, delta.text, delta.finish_reason is not None)
        written = events.reasoning(thought) if thought else []
        message, _ = self.plan.tools.delta(0, content, delta.finish_reason)
        written += events.text(message.content) if message.content else []
        for piece in message.tool_calls or []:
            written += events.call(piece)
        return written
