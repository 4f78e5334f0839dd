"""The Responses API (``POST /v1/responses``, ``GET``/``DELETE /v1/responses/{id}``) through the official
openai client against a real ``tokenmill serve``: each greedy answer is checked against chat completions
on the same messages (the Responses API is the chat path in another shape), streamed events against the
whole response, structured outputs against their schema, forced function calls (the tiny random model
calls nothing by itself) through a round trip, and the bounded store behind ``previous_response_id``."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from conftest import API_KEY, MODEL
from pydantic import BaseModel

from tokenmill_cli.server.response_store import ResponseStore, StoredResponse

TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}, "hour24": {"type": "boolean"}},
        "required": ["zone"]}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_time", "description": "the time in a zone", "parameters": TIME},
         {"type": "function", "name": "get_weather", "parameters": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}} for tool in TOOLS]
GREEDY = {"model": MODEL, "temperature": 0}


@pytest.fixture(scope="module")
def tools_client(start_server, tiny_args) -> openai.OpenAI:
    server = start_server(tiny_args("--tool-call-parser", "hermes", "--enable-auto-tool-choice"))
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def chat_reply(client: openai.OpenAI, messages: list[dict], max_tokens: int, **kwargs):
    return client.chat.completions.create(messages=messages, max_tokens=max_tokens, **GREEDY, **kwargs).choices[0]


def _assert_matches_chat(response, choice, usage) -> None:
    """A response says what chat completions says for the same messages, and counts the same tokens."""
    assert response.output_text == choice.message.content
    assert response.status == ("incomplete" if choice.finish_reason == "length" else "completed")
    if choice.finish_reason == "length":
        assert response.incomplete_details.reason == "max_output_tokens"
    assert (response.usage.input_tokens, response.usage.output_tokens) == (usage.prompt_tokens,
                                                                          usage.completion_tokens)
    assert response.usage.total_tokens == usage.total_tokens


# -- plain ---------------------------------------------------------------------------------------------
def test_text_input_with_instructions_is_the_chat_reply(client):
    response = client.responses.create(input="Tell me a story", instructions="You are terse.", max_output_tokens=12,
                                       **GREEDY)
    chat = client.chat.completions.create(messages=[{"role": "system", "content": "You are terse."},
                                                    {"role": "user", "content": "Tell me a story"}],
                                          max_tokens=12, **GREEDY)
    _assert_matches_chat(response, chat.choices[0], chat.usage)
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    assert response.instructions == "You are terse." and response.max_output_tokens == 12
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [part.type for part in message.content] == ["output_text"]


def test_message_items_are_the_chat_messages(client):
    items = [{"role": "developer", "content": "Answer in French."},
             {"role": "user", "content": [{"type": "input_text", "text": "Hello "},
                                          {"type": "input_text", "text": "there"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Bonjour"}]},
             {"role": "user", "content": "And then?"}]
    messages = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello there"},
                {"role": "assistant", "content": "Bonjour"}, {"role": "user", "content": "And then?"}]
    response = client.responses.create(input=items, max_output_tokens=10, **GREEDY)
    chat = client.chat.completions.create(messages=messages, max_tokens=10, **GREEDY)
    _assert_matches_chat(response, chat.choices[0], chat.usage)


def test_max_output_tokens_makes_an_incomplete_response(client):
    response = client.responses.create(input="Count to one hundred", max_output_tokens=3, **GREEDY)
    assert response.usage.output_tokens == 3
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[-1].status == "incomplete"


# -- streamed ------------------------------------------------------------------------------------------
TEXT_EVENTS = ["response.output_item.added", "response.content_part.added", "response.output_text.done",
               "response.content_part.done", "response.output_item.done"]


def _without_deltas(events) -> list[str]:
    return [e.type for e in events if not e.type.endswith(".delta")]


def test_streamed_events_build_the_whole_response(client):
    args = {"input": "Tell me a story", "instructions": "You are terse.", "max_output_tokens": 16, **GREEDY}
    whole = client.responses.create(**args)
    events = list(client.responses.create(stream=True, **args))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    terminal = f"response.{whole.status}"
    assert _without_deltas(events) == ["response.created", "response.in_progress", *TEXT_EVENTS, terminal]
    created, final = events[0].response, events[-1].response
    assert created.status == "in_progress" and created.output == [] and created.id == final.id
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas and "".join(e.delta for e in deltas) == whole.output_text
    (added,) = [e for e in events if e.type == "response.output_item.added"]
    assert {e.item_id for e in deltas} == {added.item.id} == {final.output[0].id}
    assert [e.text for e in events if e.type == "response.output_text.done"] == [whole.output_text]
    assert final.output_text == whole.output_text and final.status == whole.status
    assert final.usage.model_dump() == whole.usage.model_dump()
    assert client.responses.retrieve(final.id).output_text == whole.output_text  # stored once complete


class Pick(BaseModel):
    color: Literal["red", "green", "blue"]
    ok: bool


def test_the_sdk_stream_helper_parses_a_structured_response(client):
    """``responses.stream`` checks the events' indices and ids as it assembles them."""
    with client.responses.stream(input="Pick a color", text_format=Pick, max_output_tokens=200, **GREEDY) as stream:
        final = stream.get_final_response()
    assert isinstance(final.output_parsed, Pick)
    assert final.output_parsed == Pick.model_validate_json(final.output_text)


# -- structured outputs ----------------------------------------------------------------------------------
def test_json_schema_format_validates(client):
    text = {"format": {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}}
    response = client.responses.create(input="The weather?", text=text, max_output_tokens=200, **GREEDY)
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), WEATHER)
    assert response.text.format.type == "json_schema" and response.text.format.name == "weather"


def test_json_object_format_and_parse(client):
    response = client.responses.create(input="Some JSON", text={"format": {"type": "json_object"}},
                                       max_output_tokens=60, **GREEDY)
    assert response.output_text.lstrip().startswith("{")
    if response.status == "completed":  # any object: it may run past the limit
        assert isinstance(json.loads(response.output_text), dict)
    parsed = client.responses.parse(input="Pick a color", text_format=Pick, max_output_tokens=200, **GREEDY)
    assert isinstance(parsed.output_parsed, Pick)


# -- function calls --------------------------------------------------------------------------------------
NAMED = {"type": "function", "name": "get_time"}


def _calls(response) -> list:
    return [item for item in response.output if item.type == "function_call"]


# one call: given the chance, a random model calls again and again until max_output_tokens cuts it
@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_forced_calls_are_function_call_items(tools_client, tool_choice):
    response = tools_client.responses.create(input="What time is it?", tools=TOOLS, tool_choice=tool_choice,
                                             parallel_tool_calls=False, max_output_tokens=150, **GREEDY)
    calls = _calls(response)
    assert calls and response.status == "completed" and response.output_text == ""
    for call in calls:
        assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), {"get_time": TIME, "get_weather": WEATHER}[call.name])
    if tool_choice == NAMED:
        assert [call.name for call in calls] == ["get_time"]


def test_streamed_calls_equal_whole_ones(tools_client):
    args = {"input": "What time is it?", "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
            "max_output_tokens": 150, **GREEDY}
    whole = _calls(tools_client.responses.create(**args))
    events = list(tools_client.responses.create(stream=True, **args))
    final = _calls(events[-1].response)
    assert [(c.name, c.arguments) for c in final] == [(c.name, c.arguments) for c in whole]
    for call in final:
        mine = [e for e in events if getattr(e, "item_id", None) == call.id]
        assert "".join(e.delta for e in mine if e.type == "response.function_call_arguments.delta") == call.arguments
        assert [e.arguments for e in mine if e.type == "response.function_call_arguments.done"] == [call.arguments]
    kinds = _without_deltas(events)
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed"


def test_a_call_and_its_output_continue_the_conversation(tools_client):
    """The call goes back as the model's output item, its result as a function_call_output item;
    the reply is the chat reply to the assistant tool call and tool message they stand for."""
    question = {"role": "user", "content": "What time is it?"}
    first = tools_client.responses.create(input=[question], tools=TOOLS, tool_choice=NAMED, max_output_tokens=150,
                                          **GREEDY)
    (call,) = _calls(first)
    result = json.dumps({"time": "12:00"})
    follow_up = tools_client.responses.create(
        input=[question, *first.output, {"type": "function_call_output", "call_id": call.call_id, "output": result}],
        tools=TOOLS, tool_choice="none", max_output_tokens=8, **GREEDY)
    messages = [question, {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call.call_id, "type": "function",
                     "function": {"name": call.name, "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": result}]
    chat = tools_client.chat.completions.create(messages=messages, tools=CHAT_TOOLS, tool_choice="none",
                                                max_tokens=8, **GREEDY)
    _assert_matches_chat(follow_up, chat.choices[0], chat.usage)
    # the same conversation through the store
    stored = tools_client.responses.create(
        previous_response_id=first.id, tools=TOOLS, tool_choice="none", max_output_tokens=8, **GREEDY,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": result}])
    assert stored.output_text == follow_up.output_text


def test_auto_reads_calls_from_model_output(tools_client):
    """A regex (vLLM's structured_outputs extra) holds the tiny model to a hermes call's text."""
    hermes = r'<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}\n</tool_call>'
    response = tools_client.responses.create(input="What time is it?", tools=TOOLS, max_output_tokens=60, **GREEDY,
                                             extra_body={"structured_outputs": {"regex": hermes}})
    assert [c.name for c in _calls(response)] == ["get_time"], response.output


# -- the store --------------------------------------------------------------------------------------------
def test_previous_response_id_continues_without_the_instructions(client):
    first = client.responses.create(input="Hi", instructions="Be brief.", max_output_tokens=6, **GREEDY)
    second = client.responses.create(input="And then?", previous_response_id=first.id, max_output_tokens=6,
                                     **GREEDY)
    assert second.previous_response_id == first.id
    # instructions are not carried over (OpenAI's rule): the conversation is the items only
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"},
                                                    {"role": "assistant", "content": first.output_text},
                                                    {"role": "user", "content": "And then?"}],
                                          max_tokens=6, **GREEDY)
    _assert_matches_chat(second, chat.choices[0], chat.usage)
    third = client.responses.create(input="More", previous_response_id=second.id, max_output_tokens=6, **GREEDY)
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"},
                                                    {"role": "assistant", "content": first.output_text},
                                                    {"role": "user", "content": "And then?"},
                                                    {"role": "assistant", "content": second.output_text},
                                                    {"role": "user", "content": "More"}],
                                          max_tokens=6, **GREEDY)
    _assert_matches_chat(third, chat.choices[0], chat.usage)


def test_retrieve_and_delete(client, http):
    response = client.responses.create(input="Hi", max_output_tokens=4, metadata={"run": "7"}, **GREEDY)
    assert client.responses.retrieve(response.id).model_dump() == response.model_dump()
    assert response.store is True and response.metadata == {"run": "7"}
    deleted = http.delete(f"/v1/responses/{response.id}")
    assert deleted.status_code == 200 and deleted.json() == {"id": response.id, "object": "response.deleted",
                                                             "deleted": True}
    for answer in (http.get(f"/v1/responses/{response.id}"), http.delete(f"/v1/responses/{response.id}")):
        assert answer.status_code == 404 and answer.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_store_false_keeps_nothing(client):
    response = client.responses.create(input="Hi", max_output_tokens=4, store=False, **GREEDY)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(input="Hi", previous_response_id=response.id, max_output_tokens=4, **GREEDY)
    assert caught.value.body["param"] == "previous_response_id"
    assert caught.value.body["code"] == "previous_response_not_found"


def test_the_store_keeps_the_most_recently_used(start_server, tiny_args):
    server = start_server(tiny_args("--max-stored-responses", "2"))
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    first, second = (client.responses.create(input=text, max_output_tokens=2, **GREEDY) for text in ("a", "b"))
    client.responses.retrieve(first.id)  # now the most recently used: the next one evicts `second`
    third = client.responses.create(input="c", max_output_tokens=2, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    assert {client.responses.retrieve(r.id).id for r in (first, third)} == {first.id, third.id}
    # a continuation outlives its evicted ancestors: each entry holds its whole conversation
    fourth = client.responses.create(input="d", previous_response_id=third.id, max_output_tokens=2, **GREEDY)
    fifth = client.responses.create(input="e", previous_response_id=fourth.id, max_output_tokens=2, **GREEDY)
    chat = client.chat.completions.create(max_tokens=2, **GREEDY, messages=[
        {"role": "user", "content": "c"}, {"role": "assistant", "content": third.output_text},
        {"role": "user", "content": "d"}, {"role": "assistant", "content": fourth.output_text},
        {"role": "user", "content": "e"}])
    _assert_matches_chat(fifth, chat.choices[0], chat.usage)


def test_response_store_is_a_bounded_lru():
    store = ResponseStore(2)
    entries = {name: StoredResponse({"id": name}, ()) for name in "abc"}
    store.put("a", entries["a"])
    store.put("b", entries["b"])
    assert store.get("a") is entries["a"]
    store.put("c", entries["c"])
    assert len(store) == 2 and store.get("b") is None and store.get("c") is entries["c"]
    assert store.delete("a") and not store.delete("a") and len(store) == 1
    nothing = ResponseStore(0)
    nothing.put("a", entries["a"])
    assert len(nothing) == 0 and nothing.get("a") is None
    with pytest.raises(ValueError):
        ResponseStore(-1)


# -- bad input, auth, disconnects -------------------------------------------------------------------------
OMITTED = object()
BAD = {
    "no input": ({"input": OMITTED}, "input"),
    "empty input": ({"input": ""}, "input"),
    "no items": ({"input": []}, "input"),
    "unknown role": ({"input": [{"role": "critic", "content": "x"}]}, "input"),
    "item reference": ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    "image part": ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    "text part without text": ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input"),
    "call output without its call": ({"input": [{"type": "function_call_output", "output": "1"}]}, "input"),
    "built-in tool": ({"tools": [{"type": "web_search"}]}, "tools"),
    "nameless function": ({"tools": [{"type": "function", "parameters": TIME}]}, "tools"),
    "format and structured_outputs": ({"text": {"format": {"type": "json_object"}},
                                       "structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    "choice not offered": ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "rm"}}, "tool_choice"),
    "required without tools": ({"tool_choice": "required"}, "tool_choice"),
    "auto without a parser": ({"tools": TOOLS}, "tool_choice"),
    "unknown format": ({"text": {"format": {"type": "yaml"}}}, "text"),
    "schema missing": ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    "bad schema": ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strnig"}}}},
                   "text.format.schema"),
    "temperature": ({"temperature": 3}, "temperature"),
    "max_output_tokens": ({"max_output_tokens": 0}, "max_output_tokens"),
    "background": ({"background": True}, "background"),
    "conversation": ({"conversation": "conv_1"}, "conversation"),
    "top_logprobs": ({"top_logprobs": 5}, "top_logprobs"),
    "timeout": ({"timeout": 0}, "timeout"),
    "truncation": ({"truncation": "auto"}, "truncation"),
    "unknown previous": ({"previous_response_id": "resp_nope"}, "previous_response_id"),
    "too long": ({"input": "word " * 400}, "input"),
    "not an object": ({"input": "hi", "metadata": "x"}, "metadata"),
}


@pytest.mark.parametrize("extra,param", BAD.values(), ids=BAD.keys())
def test_bad_requests_are_400s_naming_the_field(http, extra, param):
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 4, **extra}
    answer = http.post("/v1/responses", json={k: v for k, v in body.items() if v is not OMITTED})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param, error


def test_streaming_errors_come_before_the_stream(client):
    with pytest.raises(openai.BadRequestError):
        client.responses.create(input="hi", text={"format": {"type": "json_schema", "name": "x",
                                                             "schema": {"type": "strnig"}}}, stream=True)


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model="gpt-9", input="hi")
    assert caught.value.body["code"] == "model_not_found"


def test_the_schema_documents_the_routes(http):
    schema = http.get("/openapi.json").json()
    paths = schema["paths"]
    assert set(paths["/v1/responses"]) == {"post"}
    # what is refused is not in the schema: function tools only, no item kinds but those served
    request = schema["components"]["schemas"]["ResponsesRequest"]["properties"]
    assert request["tools"]["anyOf"][0]["items"] == {"oneOf": [{"$ref": "#/components/schemas/FunctionTool"}]}
    assert "OtherItem" not in json.dumps(request["input"]) and "background" in request
    assert set(paths["/v1/responses/{response_id}"]) == {"get", "delete"}
    assert "404" in paths["/v1/responses/{response_id}"]["get"]["responses"]


@pytest.mark.parametrize("method,path", [("POST", "/v1/responses"), ("GET", "/v1/responses/resp_1"),
                                         ("DELETE", "/v1/responses/resp_1")])
def test_the_routes_need_the_key(server, method, path):
    for headers in ({}, {"Authorization": "Bearer nope"}):
        answer = httpx.request(method, server.url + path, headers=headers, json={"input": "hi"})
        assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"
    keyed = httpx.request(method, server.url + path, headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"model": MODEL, "input": "hi", "max_output_tokens": 2})
    assert keyed.status_code == (200 if method == "POST" else 404)


BLOCKER = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 240, "temperature": 0, "ignore_eos": True,
           "n": 16, "stream": True}


@pytest.fixture(scope="module")
def single_seq(start_server, tiny_args):
    """One sequence slot: a blocker on it makes a later request wait for its first token."""
    return start_server(tiny_args("--max-num-seqs", "1"))


def test_a_timeout_makes_an_incomplete_response(single_seq):
    client = openai.OpenAI(base_url=f"{single_seq.url}/v1", api_key="none", max_retries=0, timeout=30)
    args = {"input": "hi", "max_output_tokens": 50, "extra_body": {"timeout": 0.3}, **GREEDY}
    with httpx.Client(base_url=single_seq.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=BLOCKER) as held:
            lines = held.iter_lines()  # kept: a dropped iterator closes the response
            assert next(lines).startswith("data: {")
            whole = client.responses.create(**args)
            events = list(client.responses.create(stream=True, **args))
    for response in (whole, events[-1].response):
        assert response.status == "incomplete" and response.incomplete_details.reason == "timeout"
        assert response.output_text == "" and response.usage.output_tokens == 0
        assert [(item.type, item.status) for item in response.output] == [("message", "incomplete")]
    assert _without_deltas(events) == ["response.created", "response.in_progress", *TEXT_EVENTS,
                                       "response.incomplete"]


def test_clients_that_leave_abort_their_requests(single_seq):
    """With one sequence slot held by a long request, a response cannot start before its client gives up."""
    server = single_seq
    server.wait_idle()
    before = server.stats()["client_disconnects"]
    with httpx.Client(base_url=server.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=BLOCKER) as held:
            lines = held.iter_lines()  # kept: a dropped iterator closes the response
            assert next(lines).startswith("data: {")
            for stream in (False, True):
                with pytest.raises(httpx.ReadTimeout):
                    http.post("/v1/responses", timeout=0.3,
                              json={"model": MODEL, "input": "hi", "max_output_tokens": 5, "stream": stream})
    stats = server.wait_idle()
    assert stats["running"] == stats["waiting"] == stats["unfinished"] == 0, stats
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], stats
    assert stats["client_disconnects"] == before + 3, stats  # the two, and the blocker closed mid-stream
