"""schemathesis against the running server's own ``/openapi.json``: every schema-valid request is
accepted (2xx), nothing is a 5xx, every answer has a documented status, content type and body.

The examples are derandomized and bounded: a short run here, a longer one marked ``long`` (deselected by
default: ``bash scripts/test -m long``). A few
request fields take languages the schema cannot describe (a regular expression, a JSON schema, a
Jinja template, a grammar), depend on the server's flags (tools need --tool-call-parser), or
relate two fields in ways it cannot state (``min_tokens`` at most ``max_tokens``, a prompt within
the context, ``continue_final_message``'s last message having content): :func:`_schema_expressible`
keeps generated bodies to what the schema can promise, and says which.
"""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from conftest import API_KEY
from hypothesis import HealthCheck, assume, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    positive_data_acceptance,
    response_schema_conformance,
    status_code_conformance,
)

CHECKS = [not_a_server_error, response_schema_conformance, status_code_conformance, content_type_conformance,
          positive_data_acceptance]
SHORT_EXAMPLES = 12
LONG_EXAMPLES = 150
_MAX_PROMPT = 120  # characters or token ids: well within the tiny model's 256-token context
# fields whose values are programs in another language (regex, JSON schema, Jinja, EBNF) or free-form
# objects handed on to a chat template: their validity is the engine's to judge, not the schema's
# (tools and tool_choice also depend on the server's --tool-call-parser and --enable-auto-tool-choice)
_OUTSIDE_THE_SCHEMA = ("structured_outputs", "chat_template", "tools", "tool_choice")


@pytest.fixture(scope="module")
def api_schema(server):
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    schema.config.update(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"})
    return schema.include(path_regex="^/(v1/|tokenize|detokenize|health|ready|version|engine)")


schema = schemathesis.pytest.from_fixture("api_schema")


def _schema_expressible(body: Any) -> bool:
    if not isinstance(body, dict):
        return True
    if any(body.get(field) is not None for field in _OUTSIDE_THE_SCHEMA):
        return False
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and isinstance(response_format.get("json_schema"), dict) and \
            response_format["json_schema"].get("schema") is not None:
        return False  # a JSON schema of its own: the grammar backend judges it
    text = body.get("text")
    if isinstance(text, dict) and isinstance(text.get("format"), dict) and text["format"].get("schema") is not None:
        return False  # the Responses API's text.format json_schema: the same
    if body.get("previous_response_id") is not None:
        return False  # names a response the server may or may not have stored: its state, not the schema
    messages = body.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[-1], dict) and \
            messages[-1].get("role") == "assistant" and isinstance(messages[-1].get("content"), list) and \
            any(isinstance(b, dict) and b.get("type") == "tool_use" for b in messages[-1]["content"]):
        return False  # Messages API: a last assistant turn is continued, and cannot be once it called a tool
    if isinstance(messages, list) and any(
            isinstance(m, dict) and isinstance(m.get("content"), list)
            and any(isinstance(p, dict) and p.get("type") in ("image_url", "video_url") for p in m["content"])
            for m in messages):
        return False  # an image (a video): its bytes, and whether the model takes them, are the server's to judge
    items = body.get("input")
    if isinstance(items, list) and items and all(isinstance(i, dict) and i.get("type") == "reasoning" for i in items):
        return False  # reasoning items alone leave the prompt nothing to answer (they are not replayed to it)
    max_tokens = body.get("max_tokens", 16 if "prompt" in body else None)  # completions' default: 16
    max_tokens = body.get("max_completion_tokens", max_tokens)
    if _number(body.get("min_tokens")) and _number(max_tokens) and body["min_tokens"] > max_tokens:
        return False
    if body.get("continue_final_message") and isinstance(messages, list) and messages and not (
            isinstance(messages[-1], dict) and messages[-1].get("content")):
        return False  # continuing the last message needs it to have content
    sides = [len(t) for t in (body.get("text_1"), body.get("text_2")) if isinstance(t, list) and len(t) > 1]
    if len(set(sides)) > 1:
        return False  # score: two lists of texts must be equally long
    return all(_size(body.get(field)) <= _MAX_PROMPT
               for field in ("prompt", "input", "messages", "query", "documents", "text_1", "text_2"))


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _size(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(_size(v) if not isinstance(v, int) else 1 for v in value)
    if isinstance(value, dict):
        return sum(_size(v) for v in value.values())
    return 0


def _run(case: Any) -> None:
    assume(_schema_expressible(case.body))
    case.call_and_validate(checks=CHECKS, timeout=60)


@schema.parametrize()
@settings(max_examples=SHORT_EXAMPLES, derandomize=True, deadline=None,
          suppress_health_check=list(HealthCheck))
def test_schema_short(case):
    _run(case)


@pytest.mark.long
@schema.parametrize()
@settings(max_examples=LONG_EXAMPLES, derandomize=True, deadline=None,
          suppress_health_check=list(HealthCheck))
def test_schema_long(case):
    _run(case)


# -- what the schema says, read directly --------------------------------------------------------
def test_schema_carries_the_real_constraints(http, llama_path):
    from transformers import AutoTokenizer

    schema = http.get("/openapi.json").json()
    parts = schema["components"]["schemas"]
    assert set(parts["ToolMessage"]["required"]) == {"role", "content", "tool_call_id"}
    assert parts["CompletionRequest"]["properties"]["prompt"]["anyOf"][0] == {"type": "string", "minLength": 1}
    last_id = len(AutoTokenizer.from_pretrained(llama_path)) - 1
    assert parts["DetokenizeRequest"]["properties"]["tokens"]["items"] == {"type": "integer", "minimum": 0,
                                                                          "maximum": last_id}
    for path in ("/health", "/ready"):
        assert {"200", "503"} <= set(schema["paths"][path]["get"]["responses"])
    assert not any("422" in op["responses"] for ops in schema["paths"].values() for op in ops.values())


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, None), ("/v1/embeddings", {"input": ""}, "input"), ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/detokenize", {"tokens": [10**6]}, "tokens"), ("/v1/chat/completions", {"messages": [{"role": "tool"}]}, "messages"),
])
def test_what_the_schema_rejects_is_a_400_in_openai_shape(http, path, body, param):
    response = http.post(path, json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param
