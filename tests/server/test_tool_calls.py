"""Tool calling through the official openai client against a real ``tokenmill serve --tool-call-parser
hermes``: forced calls (``required``, a named function) on the tiny random model, whose grammar makes
any model's reply a valid call; ``auto`` on what the parser reads from real model output (the tiny
model held to a call's text by a regex, and SmolLM2 prompted to call); streamed deltas assembled as a
client does; and the conversation continued with the call and its result."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from conftest import API_KEY, MODEL

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}, "hour24": {"type": "boolean"}},
        "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture(scope="module")
def tools_client(start_server, tiny_args) -> openai.OpenAI:
    server = start_server(tiny_args("--tool-call-parser", "hermes", "--enable-auto-tool-choice"))
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def call(client, stream: bool, model: str = MODEL, messages=MESSAGES, **kwargs) -> tuple[str | None, list, str]:
    """(content, [(id, name, arguments)], finish_reason) of one greedy reply, streamed or not."""
    args = {"model": model, "messages": messages, "max_tokens": 150, "temperature": 0, "tools": TOOLS, **kwargs}
    if not stream:
        choice = client.chat.completions.create(**args).choices[0]
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        assert all(c.type == "function" for c in choice.message.tool_calls or [])
        return choice.message.content, calls, choice.finish_reason
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **args):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            if piece.id is not None:  # the first piece of a call: its id, type and name
                assert piece.index not in calls and piece.type == "function"
                calls[piece.index] = [piece.id, piece.function.name, ""]
            calls[piece.index][2] += piece.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    return content or None, [tuple(c) for c in calls.values()], reason


def assert_valid(calls: list, names: set[str] | None = None) -> None:
    assert calls
    for call_id, name, arguments in calls:
        assert call_id.startswith("call_") and (names is None or name in names)
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("tool_choice,names", [("required", {"get_weather", "get_time"}), (NAMED, {"get_time"})],
                         ids=["required", "named"])
def test_forced_calls_parse_and_validate(tools_client, tool_choice, names, stream):
    content, calls, reason = call(tools_client, stream, tool_choice=tool_choice)
    assert content is None and reason == "tool_calls"
    assert_valid(calls, names)
    if tool_choice == NAMED:
        assert len(calls) == 1


def test_streamed_calls_equal_whole_ones(tools_client):
    _, whole, _ = call(tools_client, False, tool_choice="required")
    _, streamed, _ = call(tools_client, True, tool_choice="required")
    assert [c[1:] for c in streamed] == [c[1:] for c in whole]  # ids differ, names and arguments do not


def test_required_with_parallel_calls_off_makes_one_call(tools_client):
    for stream in (False, True):
        _, calls, reason = call(tools_client, stream, tool_choice="required", parallel_tool_calls=False)
        assert len(calls) == 1 and reason == "tool_calls"
        assert_valid(calls)


# The tiny model cannot decide to call; a regex holds it to text a model would write, so `auto`
# parses real output of the engine (streamed token by token) rather than a string made in the test.
HERMES_CALL = r'Sure\. <tool_call>\n\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_parses_calls_and_content_from_model_output(tools_client, stream):
    content, calls, reason = call(tools_client, stream, tool_choice="auto",
                                  extra_body={"structured_outputs": {"regex": HERMES_CALL}})
    assert content == "Sure." and reason == "tool_calls"
    assert_valid(calls, {"get_time"})
    plain, no_calls, plain_reason = call(tools_client, stream, extra_body={"structured_outputs": {"regex": "[a-z]{4}"}})
    assert len(plain) == 4 and no_calls == [] and plain_reason == "stop"  # auto is the default with tools


def test_tool_choice_none_leaves_the_reply_alone(tools_client):
    content, calls, _ = call(tools_client, False, tool_choice="none",
                             extra_body={"structured_outputs": {"regex": HERMES_CALL}})
    assert calls == [] and content.startswith("Sure. <tool_call>")


def test_a_call_and_its_result_continue_the_conversation(tools_client):
    _, calls, _ = call(tools_client, False, tool_choice=NAMED)
    (call_id, name, arguments), = calls
    messages = [*MESSAGES,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": call_id, "content": json.dumps({"time": "12:00"})}]
    reply = tools_client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                                 max_tokens=5)
    assert reply.choices[0].message.content is not None and not reply.choices[0].message.tool_calls


TOOL_ERRORS = {
    "named tool not offered": (dict(tool_choice={"type": "function", "function": {"name": "rm"}}), "tool_choice"),
    "required without tools": (dict(tools=None, tool_choice="required"), "tool_choice"),
    "unknown choice": (dict(tool_choice="sometimes"), "tool_choice"),
    "forced and response_format": (dict(tool_choice="required", response_format={"type": "json_object"}),
                                   "tool_choice"),
    "malformed tool": (dict(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools"),
    "invalid parameters schema": (dict(tool_choice="required", tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "strnig"}}}}}]), "tools"),
    "tool message without its call id": (dict(messages=[*MESSAGES, {"role": "tool", "content": "12:00"}]),
                                         "messages"),
}


@pytest.mark.parametrize("kwargs,param", TOOL_ERRORS.values(), ids=TOOL_ERRORS.keys())
def test_bad_tool_requests_are_400s_naming_the_field(tools_client, kwargs, param):
    args = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "tools": TOOLS, **kwargs}
    with pytest.raises(openai.BadRequestError) as caught:
        tools_client.chat.completions.create(**args)
    assert caught.value.body["param"] == param, caught.value.body


def test_a_server_without_a_parser_refuses_calls_it_cannot_read(client):
    for tool_choice in ("auto", "required"):
        with pytest.raises(openai.BadRequestError, match=r"--tool-call-parser|--enable-auto-tool-choice") as caught:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                                           max_tokens=5)
        assert caught.value.body["param"] == "tool_choice"
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                           max_tokens=3)
    assert reply.choices[0].message.tool_calls is None
    assert API_KEY  # the `client` fixture's server is the keyed one


# -- the default model (SmolLM2-135M-Instruct), which writes the call itself ------------------------
SHOTS = [{"role": "system", "content": 'You call tools. To call get_weather, write <tool_call>{"name": '
                                       '"get_weather", "arguments": {"city": CITY, "unit": "celsius"}}</tool_call>'},
         {"role": "user", "content": "What is the weather in Rome?"},
         {"role": "assistant", "content": '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", '
                                          '"unit": "celsius"}}</tool_call>'},
         {"role": "user", "content": "What is the weather in Madrid?"},
         {"role": "assistant", "content": '<tool_call>{"name": "get_weather", "arguments": {"city": "Madrid", '
                                          '"unit": "celsius"}}</tool_call>'}]


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_on_the_real_model(smollm_client, stream):
    messages = [*SHOTS, {"role": "user", "content": "What is the weather in Paris?"}]
    content, calls, reason = call(smollm_client, stream, model=smollm_client.model, messages=messages,
                                  tool_choice="auto")
    assert content is None and reason == "tool_calls"
    assert_valid(calls, {"get_weather"})
    assert json.loads(calls[0][2])["city"] == "Paris"


@pytest.mark.slow
def test_required_on_the_real_model(smollm_client):
    # one call: given the chance, a 135M model repeats its call until max_tokens
    content, calls, reason = call(smollm_client, True, model=smollm_client.model, tool_choice="required",
                                  parallel_tool_calls=False,
                                  messages=[{"role": "user", "content": "What time is it in UTC?"}])
    assert reason == "tool_calls" and content is None
    assert_valid(calls)
