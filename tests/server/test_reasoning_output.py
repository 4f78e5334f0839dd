"""Reasoning output through the official openai client against a real ``tokenmill serve
--reasoning-parser``: a tiny model that recites ``<think>`` replies (``reasoning_model``), its
reasoning section in ``message.reasoning_content`` and the answer alone in ``content``, whole and
streamed; a constraint or a forced tool call applied to the answer only; and the start-up error
of an unknown parser name."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import jsonschema
import openai
import pytest
from conftest import MODEL, tokenmill_command
from reasoning_model import CONTENT, PLAIN_TEMPLATE, REASONING, build_reasoning_model, script_ids

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return build_reasoning_model(tmp_path_factory.mktemp("reasoner"))


def serve_args(model_path: Path, *extra: str) -> list[str]:
    return [str(model_path), "--served-model-name", MODEL, "--max-model-len", "256", "--kv-cache-memory", "16MiB",
            "--dtype", "float32", *extra]


@pytest.fixture(scope="module")
def r1_client(start_server, model_path) -> openai.OpenAI:
    """DeepSeek-R1 style: the template opens <think> in the prompt; hermes reads calls from the answer."""
    server = start_server(serve_args(model_path, "--reasoning-parser", "deepseek_r1", "--tool-call-parser", "hermes"))
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def qwen3_client(start_server, model_path) -> openai.OpenAI:
    server = start_server(serve_args(model_path, "--reasoning-parser", "qwen3"))
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def reply(client, stream: bool, **kwargs) -> dict:
    """reasoning_content, reasoning, content, finish_reason (and for a stream: the order of the parts)."""
    args = {"model": MODEL, "messages": MESSAGES, "max_tokens": 40, "temperature": 0, **kwargs}
    if not stream:
        response = client.chat.completions.create(**args)
        message = response.choices[0].message.model_dump()
        return {"reasoning_content": message.get("reasoning_content"), "reasoning": message.get("reasoning"),
                "content": message["content"], "finish_reason": response.choices[0].finish_reason,
                "tool_calls": message.get("tool_calls"), "completion_tokens": response.usage.completion_tokens}
    parts = {"reasoning_content": "", "reasoning": "", "content": ""}
    order, finish_reason = [], None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args):
        if not chunk.choices:
            completion_tokens = chunk.usage.completion_tokens
            continue
        delta = chunk.choices[0].delta.model_dump()
        for key in parts:
            parts[key] += delta.get(key) or ""
        order += [key for key in ("reasoning_content", "content") if delta.get(key)]
        finish_reason = chunk.choices[0].finish_reason or finish_reason
    return {**{k: v or None for k, v in parts.items()}, "finish_reason": finish_reason, "order": order,
            "completion_tokens": completion_tokens}


def recited_tokens(model_path: Path, text: str) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    ids = script_ids(tokenizer)
    return len(ids) - ids.index(tokenizer.encode(text, add_special_tokens=False)[0])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_deepseek_r1_splits_reasoning_from_content(r1_client, model_path, stream):
    got = reply(r1_client, stream)
    assert got["reasoning_content"] == REASONING and got["reasoning"] == REASONING
    assert got["content"] == CONTENT and got["finish_reason"] == "stop"
    # usage counts every generated token, the reasoning section's and the </think> marker's included
    assert got["completion_tokens"] == recited_tokens(model_path, REASONING)
    if stream:  # reasoning deltas first, then content deltas, never interleaved (how many: the engine's pace)
        first_content = got["order"].index("content")
        assert set(got["order"][:first_content]) == {"reasoning_content"}
        assert set(got["order"][first_content:]) == {"content"}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_qwen3_reads_a_section_the_model_opens_itself(qwen3_client, stream):
    opened = reply(qwen3_client, stream, extra_body={"chat_template": PLAIN_TEMPLATE})
    assert opened["reasoning_content"] == f"\n{REASONING}" and opened["content"] == CONTENT
    # with the R1 template the reply never opens <think>: for qwen3 that is no reasoning at all
    unopened = reply(qwen3_client, stream)
    assert unopened["reasoning_content"] is None and unopened["content"] == f"{REASONING}</think>{CONTENT}"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_json_schema_constrains_the_answer_not_the_reasoning(r1_client, stream):
    got = reply(r1_client, stream, response_format={"type": "json_schema",
                                                    "json_schema": {"name": "city", "schema": CITY}})
    assert got["reasoning_content"] == REASONING  # the recital runs unconstrained up to </think>
    jsonschema.validate(json.loads(got["content"]), CITY)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_invalid_schema_behind_the_reasoning_is_still_a_400_naming_the_field(r1_client, stream):
    with pytest.raises(openai.BadRequestError) as caught:
        reply(r1_client, stream, response_format={"type": "json_schema", "json_schema": {
            "name": "bad", "schema": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}})
    assert caught.value.body["param"] == "response_format.json_schema.schema"


def test_a_cut_off_reply_is_all_reasoning(r1_client):
    got = reply(r1_client, False, max_tokens=3)
    assert got["content"] is None and got["finish_reason"] == "length"
    assert REASONING.startswith(got["reasoning_content"])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_forced_tool_call_follows_the_reasoning(r1_client, stream):
    response_args = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
                     "max_tokens": 150}
    if not stream:
        got = reply(r1_client, False, **response_args)
        (call,) = got["tool_calls"]
        arguments = call["function"]["arguments"]
    else:
        arguments, reasoning = "", ""
        for chunk in r1_client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, stream=True,
                                                       **response_args):
            delta = chunk.choices[0].delta
            reasoning += delta.model_dump().get("reasoning_content") or ""
            arguments += "".join(c.function.arguments or "" for c in delta.tool_calls or [])
            assert not delta.content
        got = {"reasoning_content": reasoning, "finish_reason": chunk.choices[0].finish_reason}
    assert got["reasoning_content"] == REASONING and got["finish_reason"] == "tool_calls"
    jsonschema.validate(json.loads(arguments), TOOLS[0]["function"]["parameters"])


def test_an_unknown_parser_fails_at_start_up_listing_the_registered_ones(model_path):
    result = subprocess.run([*tokenmill_command(), "serve", *serve_args(model_path, "--reasoning-parser", "nope")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "unknown reasoning parser 'nope'; registered: deepseek_r1, qwen3" in result.stderr


# -- the Responses API: a reasoning item before the message ------------------------------------

def response_items(client, stream: bool, **kwargs) -> tuple[list[dict], list[str]]:
    """The response's output items (as the SDK parsed them) and, for a stream, its event types."""
    args = {"model": MODEL, "input": MESSAGES[0]["content"], "max_output_tokens": 40, "temperature": 0, **kwargs}
    if not stream:
        return [item.model_dump() for item in client.responses.create(**args).output], []
    events = list(client.responses.create(stream=True, **args))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    (done,) = [e for e in events if e.type == "response.reasoning_text.done"]
    assert deltas == done.text  # the deltas add up to the item's text
    assert events[-1].type in ("response.completed", "response.incomplete")
    return [item.model_dump() for item in events[-1].response.output], [e.type for e in events]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_responses_api_gives_the_reasoning_its_own_item(r1_client, stream):
    items, events = response_items(r1_client, stream)
    assert [item["type"] for item in items] == ["reasoning", "message"]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": REASONING}]
    assert items[1]["content"][0]["text"] == CONTENT
    if stream:  # the reasoning item is written, and closed, before the message opens
        assert events.index("response.reasoning_text.done") < events.index("response.output_text.delta")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_responses_api_constrains_the_answer_after_the_reasoning(r1_client, stream):
    text_format = {"format": {"type": "json_schema", "name": "city", "schema": CITY}}
    items, _ = response_items(r1_client, stream, text=text_format)
    assert items[0]["content"][0]["text"] == REASONING
    jsonschema.validate(json.loads(items[1]["content"][0]["text"]), CITY)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_response_cut_off_while_thinking_has_its_reasoning_and_an_empty_message(r1_client, stream):
    items, _ = response_items(r1_client, stream, max_output_tokens=3)
    assert [item["type"] for item in items] == ["reasoning", "message"]
    assert REASONING.startswith(items[0]["content"][0]["text"])
    assert items[1]["content"][0]["text"] == "" and items[1]["status"] == "incomplete"
