"""The Anthropic Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) through the official
anthropic client against a real ``tokenmill serve``: each greedy reply is checked against chat completions
on the same messages (the Messages API is the chat path in another shape), streamed events against the
whole message, forced tool calls (the tiny random model calls nothing by itself) through a tool_result
round trip, thinking blocks on the reciting reasoning model, and errors and the key in Anthropic's shape."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Literal

import anthropic
import httpx
import jsonschema
import openai
import pytest
from conftest import API_KEY, MODEL
from pydantic import BaseModel
from reasoning_model import CONTENT, REASONING, build_reasoning_model

TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}, "hour24": {"type": "boolean"}},
        "required": ["zone"]}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"name": "get_time", "description": "the time in a zone", "input_schema": TIME},
         {"name": "get_weather", "input_schema": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "the time in a zone",
                                                 "parameters": TIME}},
              {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
# the anthropic SDK (2.x) no longer offers temperature as an argument; the API field still exists
GREEDY = {"model": MODEL, "extra_body": {"temperature": 0}}
CHAT_GREEDY = {"model": MODEL, "temperature": 0}
QUESTION = [{"role": "user", "content": "Tell me a story"}]


def anthropic_client(url: str, api_key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=api_key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    """The keyed tiny Llama; the client sends the key as ``x-api-key``, as every Anthropic client does."""
    return anthropic_client(server.url, API_KEY)


@pytest.fixture(scope="module")
def tools_urls(start_server, tiny_args) -> str:
    return start_server(tiny_args("--tool-call-parser", "hermes", "--enable-auto-tool-choice")).url


def text_of(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def _assert_matches_chat(message, choice, usage) -> None:
    """A message says what chat completions says for the same messages, and counts the same tokens."""
    assert text_of(message) == (choice.message.content or "")
    assert message.stop_reason == {"stop": "end_turn", "length": "max_tokens",
                                   "tool_calls": "tool_use"}[choice.finish_reason]
    assert (message.usage.input_tokens, message.usage.output_tokens) == (usage.prompt_tokens, usage.completion_tokens)


# -- plain ---------------------------------------------------------------------------------------------
def test_a_reply_is_the_chat_reply(claude, client):
    message = claude.messages.create(system="You are terse.", messages=QUESTION, max_tokens=12, **GREEDY)
    chat = client.chat.completions.create(messages=[{"role": "system", "content": "You are terse."}, *QUESTION],
                                          max_tokens=12, **CHAT_GREEDY)
    _assert_matches_chat(message, chat.choices[0], chat.usage)
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == MODEL and [block.type for block in message.content] == ["text"]


def test_blocks_and_system_blocks_are_the_chat_messages(claude, client):
    turns = [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "Bonjour"}]},
             {"role": "user", "content": "And then?"}]
    message = claude.messages.create(system=[{"type": "text", "text": "Answer in French."}], messages=turns,
                                     max_tokens=10, **GREEDY)
    chat = client.chat.completions.create(max_tokens=10, **CHAT_GREEDY, messages=[
        {"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "Bonjour"}, {"role": "user", "content": "And then?"}])
    _assert_matches_chat(message, chat.choices[0], chat.usage)


def test_a_last_assistant_turn_is_continued(claude, client):
    """Anthropic's prefill: the reply continues the assistant's text, as chat's continue_final_message does."""
    turns = [*QUESTION, {"role": "assistant", "content": "Once upon"}]
    message = claude.messages.create(messages=turns, max_tokens=8, **GREEDY)
    chat = client.chat.completions.create(messages=turns, max_tokens=8, **CHAT_GREEDY,
                                          extra_body={"continue_final_message": True, "add_generation_prompt": False})
    _assert_matches_chat(message, chat.choices[0], chat.usage)


def test_max_tokens_is_the_stop_reason(claude):
    message = claude.messages.create(messages=[{"role": "user", "content": "Count to one hundred"}], max_tokens=3,
                                     **GREEDY)
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 3 and message.stop_sequence is None


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_stop_sequence_ends_the_reply(claude, stream):
    whole = text_of(claude.messages.create(messages=QUESTION, max_tokens=24, **GREEDY))
    stop = whole.strip()[len(whole.strip()) // 2:][:3]  # a piece from the middle of the reply
    assert len(stop) == 3, whole
    args = {"messages": QUESTION, "max_tokens": 24, "stop_sequences": ["\x00never", stop], **GREEDY}
    if stream:
        with claude.messages.stream(**args) as events:
            streamed = "".join(events.text_stream)
            message = events.get_final_message()
        assert streamed == text_of(message)
    else:
        message = claude.messages.create(**args)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert text_of(message) == whole[:whole.index(stop)]


def test_count_tokens_is_the_prompt_a_message_counts(claude):
    args = {"system": "You are terse.", "messages": QUESTION}
    counted = claude.messages.count_tokens(model=MODEL, **args)
    assert counted.input_tokens == claude.messages.create(max_tokens=1, **args, **GREEDY).usage.input_tokens > 0


def test_blocks_with_extra_keys_count_as_their_text(claude):
    """Keys a block does not use (cache_control, citations, ...) leave its text as it is, in a tool_result's
    content too (schemathesis found such a text block refused as an unsupported kind)."""
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"zone": "UTC"}}

    def turns(block):
        return [{"role": "user", "content": "What time is it?"}, {"role": "assistant", "content": [call]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [block]}]}]
    plain = claude.messages.count_tokens(model=MODEL, tools=TOOLS, messages=turns({"type": "text", "text": "12:00"}))
    extra = claude.messages.count_tokens(model=MODEL, tools=TOOLS, messages=turns(
        {"type": "text", "text": "12:00", "cache_control": {"type": "ephemeral"}, "citations": None}))
    assert extra.input_tokens == plain.input_tokens > 0


# -- structured output -------------------------------------------------------------------------------------
class Pick(BaseModel):
    color: Literal["red", "green", "blue"]
    ok: bool


def test_the_sdk_parses_a_structured_message(claude):
    """``messages.parse`` sends the model's schema as ``output_config.format``."""
    message = claude.messages.parse(messages=[{"role": "user", "content": "Pick a color"}], output_format=Pick,
                                    max_tokens=200, **GREEDY)
    assert message.stop_reason == "end_turn" and isinstance(message.parsed_output, Pick)
    assert message.parsed_output == Pick.model_validate_json(text_of(message))


def test_a_streamed_structured_message_follows_its_schema(claude):
    output_config = {"format": {"type": "json_schema", "schema": WEATHER}}
    with claude.messages.stream(messages=[{"role": "user", "content": "The weather?"}], output_config=output_config,
                                max_tokens=200, **GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.stop_reason == "end_turn" and text == text_of(final)
    jsonschema.validate(json.loads(text), WEATHER)


# -- streamed --------------------------------------------------------------------------------------------
def test_the_stream_helper_builds_the_whole_message(claude):
    args = {"system": "You are terse.", "messages": QUESTION, "max_tokens": 16, **GREEDY}
    whole = claude.messages.create(**args)
    with claude.messages.stream(**args) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == text_of(whole) == text_of(final)
    assert final.stop_reason == whole.stop_reason and final.usage.model_dump() == whole.usage.model_dump()


def test_the_event_sequence(server):
    """Raw SSE: each ``event:`` line names its data's type, in Anthropic's order."""
    body = {"messages": QUESTION, "max_tokens": 16, "stream": True, **CHAT_GREEDY}
    with httpx.stream("POST", f"{server.url}/v1/messages", json=body, headers={"x-api-key": API_KEY},
                      timeout=60) as answer:
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in answer.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines[0::2]]
    data = [json.loads(line.removeprefix("data: ")) for line in lines[1::2]]
    assert names == [d["type"] for d in data]
    kinds = [name for name in names if name != "content_block_delta"]
    assert kinds == ["message_start", "ping", "content_block_start", "content_block_stop", "message_delta",
                     "message_stop"]
    assert data[0]["message"]["content"] == [] and data[0]["message"]["usage"]["output_tokens"] == 0
    deltas = [d["delta"] for d in data if d["type"] == "content_block_delta"]
    assert deltas and {d["type"] for d in deltas} == {"text_delta"}
    (end,) = [d for d in data if d["type"] == "message_delta"]
    assert end["delta"]["stop_reason"] == "max_tokens" and end["usage"]["output_tokens"] == 16


# -- tool use -------------------------------------------------------------------------------------------
NAMED = {"type": "tool", "name": "get_time"}


def _tool_uses(message) -> list:
    return [block for block in message.content if block.type == "tool_use"]


@pytest.mark.parametrize("tool_choice", [{"type": "any", "disable_parallel_tool_use": True}, NAMED],
                         ids=["any", "tool"])
def test_a_forced_call_is_a_tool_use_block(tools_urls, tool_choice):
    claude = anthropic_client(tools_urls)
    message = claude.messages.create(messages=[{"role": "user", "content": "What time is it?"}], tools=TOOLS,
                                     tool_choice=tool_choice, max_tokens=150, **GREEDY)
    calls = _tool_uses(message)
    assert calls and message.stop_reason == "tool_use" and text_of(message) == ""
    for call in calls:
        assert call.id.startswith("toolu_") and isinstance(call.input, dict)
        jsonschema.validate(call.input, {"get_time": TIME, "get_weather": WEATHER}[call.name])
    if tool_choice == NAMED:
        assert [call.name for call in calls] == ["get_time"]


def test_a_streamed_call_is_the_whole_one(tools_urls):
    claude = anthropic_client(tools_urls)
    args = {"messages": [{"role": "user", "content": "What time is it?"}], "tools": TOOLS, "tool_choice": NAMED,
            "max_tokens": 150, **GREEDY}
    whole = _tool_uses(claude.messages.create(**args))
    with claude.messages.stream(**args) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert [(c.name, c.input) for c in _tool_uses(final)] == [(c.name, c.input) for c in whole]
    assert final.stop_reason == "tool_use"
    assert "content_block_start" in kinds and kinds[-1] == "message_stop"


def test_a_tool_result_round_trip_is_the_chat_reply(tools_urls):
    """The call goes back as the assistant's tool_use block, its result as a tool_result block; the reply is
    the chat reply to the assistant tool call and tool message they stand for."""
    claude = anthropic_client(tools_urls)
    chat_client = openai.OpenAI(base_url=f"{tools_urls}/v1", api_key="unused", max_retries=0, timeout=60)
    question = {"role": "user", "content": "What time is it?"}
    first = claude.messages.create(messages=[question], tools=TOOLS, tool_choice=NAMED, max_tokens=150, **GREEDY)
    (call,) = _tool_uses(first)
    result = json.dumps({"time": "12:00"})
    follow_up = claude.messages.create(
        messages=[question, {"role": "assistant", "content": [block.model_dump() for block in first.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": result}]}],
        tools=TOOLS, tool_choice={"type": "none"}, max_tokens=8, **GREEDY)
    chat = chat_client.chat.completions.create(
        messages=[question, {"role": "assistant", "content": None, "tool_calls": [
                      {"id": call.id, "type": "function",
                       "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
                  {"role": "tool", "tool_call_id": call.id, "content": result}],
        tools=CHAT_TOOLS, tool_choice="none", max_tokens=8, **CHAT_GREEDY)
    _assert_matches_chat(follow_up, chat.choices[0], chat.usage)


# -- thinking ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reasoner(start_server, tmp_path_factory) -> anthropic.Anthropic:
    """The model that recites a ``<think>`` reply, served with the deepseek_r1 reasoning parser."""
    path = build_reasoning_model(tmp_path_factory.mktemp("reasoner"))
    server = start_server([str(path), "--served-model-name", MODEL, "--max-model-len", "256", "--kv-cache-memory",
                           "16MiB", "--dtype", "float32", "--reasoning-parser", "deepseek_r1"])
    return anthropic_client(server.url)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_reasoning_is_a_thinking_block_before_the_text(reasoner, stream):
    args = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 40, **GREEDY}
    if stream:
        with reasoner.messages.stream(**args) as events:
            deltas = [event.delta for event in events if event.type == "content_block_delta"]
            message = events.get_final_message()
        thinking = [d for d in deltas if d.type == "thinking_delta"]
        assert "".join(d.thinking for d in thinking) == REASONING
        assert deltas.index(thinking[-1]) < min(i for i, d in enumerate(deltas) if d.type == "text_delta")
    else:
        message = reasoner.messages.create(**args)
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == REASONING and message.content[0].signature == ""
    assert message.content[1].text == CONTENT and message.stop_reason == "end_turn"


# -- bad input, auth -----------------------------------------------------------------------------------------
OMITTED = object()
BAD = {
    "no max_tokens": {"max_tokens": OMITTED},
    "max_tokens 0": {"max_tokens": 0},
    "no messages": {"messages": OMITTED},
    "empty messages": {"messages": []},
    "bad role": {"messages": [{"role": "system", "content": "hi"}]},
    "image block": {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url"}}]}]},
    "tool_use from the user": {"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {}}]}]},
    "tool_use without input": {"messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "get_time"}]}]},
    "ends in tool_use": {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {}}]}]},
    "tool result without its call": {"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
    "temperature": {"temperature": 1.5},
    "tool choice not offered": {"tools": TOOLS, "tool_choice": {"type": "tool", "name": "rm"}},
    "tool choice without tools": {"tool_choice": {"type": "any"}},
    "auto without a parser": {"tools": TOOLS},
    "tool without schema": {"tools": [{"name": "get_time"}]},
    "unknown tool choice": {"tools": TOOLS, "tool_choice": {"type": "sometimes"}},
    "bad output schema": {"output_config": {"format": {"type": "json_schema", "schema": {"type": "strnig"}}}},
    "output format kind": {"output_config": {"format": {"type": "yaml"}}},
    "forced call and output format": {"tools": TOOLS, "tool_choice": NAMED,
                                      "output_config": {"format": {"type": "json_schema", "schema": TIME}}},
    "too long": {"messages": [{"role": "user", "content": "word " * 400}]},
    "not json": "{",
}


@pytest.mark.parametrize("extra", BAD.values(), ids=BAD.keys())
def test_bad_requests_are_400s_in_anthropic_shape(http, extra):
    if isinstance(extra, str):
        answer = http.post("/v1/messages", content=extra, headers={"content-type": "application/json"})
    else:
        body = {"model": MODEL, "max_tokens": 4, "messages": QUESTION, **extra}
        answer = http.post("/v1/messages", json={k: v for k, v in body.items() if v is not OMITTED})
    assert answer.status_code == 400, answer.text
    error = answer.json()
    assert set(error) == {"type", "error"} and error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error" and error["error"]["message"]


def test_the_client_raises_anthropic_errors(claude):
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(messages=[], max_tokens=4, model=MODEL)
    assert "messages" in caught.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(messages=QUESTION, max_tokens=4, model="claude-9")
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):  # before the stream starts
        claude.messages.create(messages=QUESTION, max_tokens=4, model=MODEL, stream=True,
                               tools=TOOLS, tool_choice={"type": "tool", "name": "rm"})


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_the_routes_take_the_key_as_x_api_key_or_bearer(server, path):
    body = {"model": MODEL, "max_tokens": 2, "messages": QUESTION}
    for headers in ({}, {"x-api-key": "nope"}, {"Authorization": "Bearer nope"}, {"x-api-key": f"Bearer {API_KEY}"}):
        answer = httpx.post(server.url + path, headers=headers, json=body)
        assert answer.status_code == 401, headers
        assert answer.json()["type"] == "error" and answer.json()["error"]["type"] == "authentication_error"
    for headers in ({"x-api-key": API_KEY}, {"Authorization": f"Bearer {API_KEY}"}):
        assert httpx.post(server.url + path, headers=headers, json=body, timeout=60).status_code == 200, headers
    # the other routes keep OpenAI's scheme: x-api-key opens nothing else
    assert httpx.get(f"{server.url}/v1/models", headers={"x-api-key": API_KEY}).status_code == 401


def test_the_schema_documents_the_routes(http):
    schema = http.get("/openapi.json").json()
    assert set(schema["paths"]["/v1/messages"]) == {"post"}
    assert "400" in schema["paths"]["/v1/messages"]["post"]["responses"]
    request = schema["components"]["schemas"]["MessagesRequest"]
    assert {"max_tokens", "messages"} <= set(request["required"])
    for turn in ("UserMessageParam", "AssistantMessageParam"):  # each role's blocks, and no other kind
        assert "OtherBlock" not in json.dumps(schema["components"]["schemas"][turn])
    user_turn = json.dumps(schema["components"]["schemas"]["UserMessageParam"])
    assert "ToolResultBlockParam" in user_turn and "ToolUseBlockParam" not in user_turn


# -- limits: the request's timeout, a full queue ------------------------------------------------------------
BLOCKER = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 240, "temperature": 0, "ignore_eos": True,
           "n": 16, "stream": True}


@pytest.fixture(scope="module")
def queued(start_server, tiny_args):
    """One sequence slot (a blocker makes later requests wait), two queued requests at most, no key."""
    return start_server(tiny_args("--max-num-seqs", "1", "--max-queued-requests", "2"))


def test_a_timeout_is_the_stop_reason(queued):
    claude = anthropic_client(queued.url)
    args = {"messages": QUESTION, "max_tokens": 50, "model": MODEL, "extra_body": {"temperature": 0, "timeout": 0.3}}
    with httpx.Client(base_url=queued.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=BLOCKER) as held:
            lines = held.iter_lines()  # kept: a dropped iterator closes the response
            assert next(lines).startswith("data: {")
            whole = claude.messages.create(**args)
            with claude.messages.stream(**args) as stream:
                streamed = stream.get_final_message()
    for message in (whole, streamed):
        assert message.stop_reason == "timeout" and message.content == [] and message.usage.output_tokens == 0


def test_a_full_queue_is_a_429_in_anthropic_shape(queued):
    """The slot is taken and two requests wait for it: the third is refused, with Retry-After."""
    async def scenario():
        async with httpx.AsyncClient(base_url=queued.url, timeout=60) as http:
            async with http.stream("POST", "/v1/completions", json=BLOCKER) as blocker:
                lines = blocker.aiter_lines()  # kept: a dropped iterator closes the response
                await anext(lines)
                waiting = [asyncio.ensure_future(http.post("/v1/messages", json={
                    "model": MODEL, "messages": [{"role": "user", "content": f"queued {i}"}], "max_tokens": 2}))
                    for i in range(2)]
                deadline = time.monotonic() + 30
                while (await http.get("/engine/stats")).json()["queued"] < 2:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.02)
                refused = await http.post("/v1/messages", json={"model": MODEL, "messages": QUESTION,
                                                                "max_tokens": 2})
            return refused, await asyncio.gather(*waiting)  # the blocker left: the queue moves again

    refused, waited = asyncio.run(scenario())
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["type"] == "error" and refused.json()["error"]["type"] == "rate_limit_error"
    assert [r.status_code for r in waited] == [200, 200]
