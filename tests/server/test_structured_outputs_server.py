"""Structured outputs through the OpenAI API: ``response_format`` (json_object, json_schema) and
vLLM's ``structured_outputs`` extra (json, regex, choice, grammar), streamed and not, with the
official openai client against a real ``tokenmill serve`` on the tiny random model.

The schemas are the engine tests' (finite languages, so a random model must end them);
``json_object`` cannot force an end, so the real model runs it (slow)."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from conftest import MODEL
from test_structured_outputs import CHOICES, GRAMMAR, GRAMMAR_RE, REGEX, SCHEMAS

MESSAGES = [{"role": "user", "content": "The quick brown fox"}]


def chat(client, stream: bool, **kwargs) -> tuple[str, str]:
    """Content and finish reason of one greedy chat completion, streamed (deltas joined) or not."""
    args = {"model": MODEL, "messages": MESSAGES, "max_tokens": 200, "temperature": 0, **kwargs}
    if not stream:
        choice = client.chat.completions.create(**args).choices[0]
        return choice.message.content, choice.finish_reason
    chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **args) if c.choices]
    return "".join(c.delta.content or "" for c in chunks), chunks[-1].finish_reason


@pytest.mark.parametrize("name", SCHEMAS)
def test_response_format_json_schema_validates_streamed_and_not(client, name):
    response_format = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}
    whole, reason = chat(client, False, response_format=response_format)
    streamed, streamed_reason = chat(client, True, response_format=response_format)
    assert reason == streamed_reason == "stop"
    assert streamed == whole  # greedy: the same text either way
    jsonschema.validate(json.loads(whole), SCHEMAS[name])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_structured_outputs_extra_regex_choice_grammar(client, stream):
    regex, _ = chat(client, stream, extra_body={"structured_outputs": {"regex": REGEX}})
    choice, _ = chat(client, stream, extra_body={"structured_outputs": {"choice": CHOICES}})
    grammar, _ = chat(client, stream, extra_body={"structured_outputs": {"grammar": GRAMMAR}})
    schema, _ = chat(client, stream, extra_body={"structured_outputs": {"json": SCHEMAS["enums"]}})
    assert re.fullmatch(REGEX, regex) and choice in CHOICES and re.fullmatch(GRAMMAR_RE, grammar)
    jsonschema.validate(json.loads(schema), SCHEMAS["enums"])


def test_completions_take_structured_outputs_too(client):
    extra = {"structured_outputs": {"choice": CHOICES}}
    whole = client.completions.create(model=MODEL, prompt="Paged attention", max_tokens=20, temperature=0,
                                      extra_body=extra)
    streamed = client.completions.create(model=MODEL, prompt="Paged attention", max_tokens=20, temperature=0,
                                         extra_body=extra, stream=True)
    assert whole.choices[0].text in CHOICES and "".join(c.choices[0].text for c in streamed) == whole.choices[0].text


BAD = {
    "response_format.json_schema.schema": dict(response_format={"type": "json_schema", "json_schema": {
        "name": "bad", "schema": {"type": "object", "properties": {"a": {"type": "strnig"}}}}}),
    "response_format.type": dict(response_format={"type": "xml"}),
    "structured_outputs.regex": dict(extra_body={"structured_outputs": {"regex": "[a-z"}}),
    "structured_outputs.grammar": dict(extra_body={"structured_outputs": {"grammar": "root ::= undefined_rule"}}),
    "structured_outputs.json": dict(extra_body={"structured_outputs": {"json": "{not json"}}),
    "structured_outputs": dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["a"]}}),
}


@pytest.mark.parametrize("param", BAD)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_invalid_constraint_is_a_400_naming_it(client, server, param, stream):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, stream=stream, **BAD[param])
    assert caught.value.body["param"] == param, caught.value.body
    assert caught.value.body["message"]
    assert server.process.poll() is None  # never a crash


# -- the default model (SmolLM2-135M-Instruct) ---------------------------------------------------------
@pytest.mark.slow
def test_json_object_on_the_real_model(smollm_client):
    messages = [{"role": "user", "content": 'What is 2+2? Answer as a JSON object like {"answer": ...}.'}]
    for stream in (False, True):
        args = dict(model=smollm_client.model, messages=messages, max_tokens=100, temperature=0,
                    response_format={"type": "json_object"})
        if stream:
            chunks = [c.choices[0] for c in smollm_client.chat.completions.create(stream=True, **args) if c.choices]
            text, reason = "".join(c.delta.content or "" for c in chunks), chunks[-1].finish_reason
        else:
            choice = smollm_client.chat.completions.create(**args).choices[0]
            text, reason = choice.message.content, choice.finish_reason
        assert reason == "stop" and isinstance(json.loads(text), dict)
