"""Errors in OpenAI's shape, with the right status and the parameter named; auth; never a 500."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from conftest import API_KEY, MODEL

from tokenmill_cli.server.errors import describe_validation_errors

MESSAGES = [{"role": "user", "content": "hi"}]


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# -- auth ------------------------------------------------------------------------------------------
def test_openai_client_without_the_key_gets_401(server):
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        bad.models.list()
    assert caught.value.status_code == 401 and caught.value.body["code"] == "invalid_api_key"


@pytest.mark.parametrize("method,path", [("GET", "/v1/models"), ("POST", "/v1/completions"),
                                         ("POST", "/v1/chat/completions"), ("POST", "/v1/embeddings"),
                                         ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/version"),
                                         ("GET", "/engine/stats")])
def test_every_route_but_health_needs_the_key(server, method, path):
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": API_KEY}):
        error = _error(httpx.request(method, server.url + path, headers=headers, json={}), 401)
        assert "API key" in error["message"]


def test_health_needs_no_key(server):
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}


def test_api_docs_are_open_unless_asked_to_need_the_key(server, start_server, tiny_args):
    for path in ("/openapi.json", "/docs"):
        assert httpx.get(server.url + path).status_code == 200
    guarded = start_server(tiny_args("--api-docs-need-key", "--api-key", API_KEY))
    for path in ("/openapi.json", "/docs"):
        assert _error(httpx.get(guarded.url + path), 401)
    assert httpx.get(guarded.url + "/openapi.json", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200


# -- 400 / 404 through the openai client --------------------------------------------------------------
COMPLETION_ERRORS = [
    (dict(temperature=-1), "temperature"),
    (dict(temperature=3), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(n=0), "n"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(logprobs=21), "logprobs"),
    (dict(presence_penalty=3), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(logit_bias={"not-a-token": 1}), "logit_bias"),
    (dict(logit_bias={"5": 101}), "logit_bias"),
    (dict(logit_bias={"99999": 1}), "logit_bias"),
    (dict(stream_options={"include_usage": True}), "stream_options"),
    (dict(extra_body={"min_tokens": 10}, max_tokens=2), "min_tokens"),
    (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
    (dict(extra_body={"min_p": 2}), "min_p"),
    (dict(extra_body={"top_k": -5}), "top_k"),
    (dict(prompt=""), "prompt"),
    (dict(prompt=[]), "prompt"),
    (dict(prompt=[99999]), "prompt"),
    (dict(prompt="fox " * 300), "prompt"),  # longer than the 256-token context
    (dict(seed=2**70), "seed"),  # beyond int64: would overflow torch's generator
    (dict(suffix="and the end"), "suffix"),
]


@pytest.mark.parametrize("kwargs,param", COMPLETION_ERRORS, ids=[f"{p}-{i}" for i, (_, p) in
                                                                 enumerate(COMPLETION_ERRORS)])
def test_completion_bad_parameter_is_400_naming_it(client, kwargs, param):
    args = {"model": MODEL, "prompt": "hi", "max_tokens": 3, **kwargs}
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(**args)
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == param and caught.value.body["type"] == "invalid_request_error"
    assert caught.value.body["message"]


def test_prompt_longer_than_the_context_says_so(client):
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model=MODEL, prompt=list(range(5, 300)), max_tokens=1)


CHAT_ERRORS = [
    (dict(messages=[]), "messages"),
    (dict(messages=[{"role": "wizard", "content": "x"}]), "messages"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), "messages"),
    (dict(messages=[{"role": "user", "content": "fox " * 300}]), "messages"),
    (dict(top_logprobs=2), "top_logprobs"),
    (dict(logprobs=True, top_logprobs=30), "top_logprobs"),
    (dict(max_completion_tokens=0), "max_completion_tokens"),
    (dict(messages=[{"role": "tool", "content": "42"}]), "messages"),  # no tool_call_id
    (dict(messages=[{"role": "tool", "tool_call_id": "call_1"}]), "messages"),  # no content
    (dict(extra_body={"continue_final_message": True, "add_generation_prompt": True}), "continue_final_message"),
    (dict(response_format={"type": "xml"}), "response_format.type"),
]


@pytest.mark.parametrize("kwargs,param", CHAT_ERRORS, ids=[f"{p}-{i}" for i, (_, p) in enumerate(CHAT_ERRORS)])
def test_chat_bad_parameter_is_400_naming_it(client, kwargs, param):
    args = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3, **kwargs}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**args)
    assert caught.value.body["param"] == param


def test_unknown_model_is_404(client):
    for call in (lambda: client.completions.create(model="gpt-4", prompt="hi"),
                 lambda: client.chat.completions.create(model="gpt-4", messages=MESSAGES),
                 lambda: client.embeddings.create(model="gpt-4", input="hi")):
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        assert caught.value.body["param"] == "model" and caught.value.body["code"] == "model_not_found"
        assert "gpt-4" in caught.value.body["message"]


def test_streaming_errors_come_before_the_stream(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="fox " * 300, stream=True)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=9, stream=True)


# -- malformed HTTP -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize",
                                  "/detokenize"])
def test_malformed_bodies_are_400(http, path):
    assert _error(http.post(path, content=b"{not json", headers={"Content-Type": "application/json"}), 400)
    assert _error(http.post(path, json=["a", "list"]), 400)
    assert _error(http.post(path, json={"prompt": {"a": 1}, "messages": 5, "input": None, "tokens": "x"}), 400)


@pytest.mark.parametrize("path,field", [("/v1/completions", "prompt"), ("/v1/embeddings", "input"),
                                        ("/tokenize", "prompt")])
def test_lone_surrogates_are_400(http, path, field):
    """``"\\ud800"`` is valid JSON (the openai client cannot even send it) but no tokenizer encodes it."""
    body = json.dumps({field: "a\ud800"})  # ASCII-escaped, as any JSON encoder may write it
    assert _error(http.post(path, content=body, headers={"Content-Type": "application/json"}), 400)["param"] == field


def test_missing_field_is_named(http):
    assert _error(http.post("/v1/completions", json={"model": MODEL}), 400)["param"] == "prompt"
    assert _error(http.post("/v1/chat/completions", json={"model": MODEL}), 400)["param"] == "messages"
    assert _error(http.post("/detokenize", json={"tokens": [10**9]}), 400)["param"] == "tokens"


def test_unknown_route_and_method(http):
    assert _error(http.get("/v1/nothing"), 404)
    assert _error(response := http.get("/v1/completions"), 405)
    assert response.headers["allow"] == "POST"


@pytest.mark.parametrize("extra", [
    {"n": 128, "max_tokens": 1}, {"top_k": 10**9}, {"priority": 10**30}, {"stop": ["x"] * 100}, {"stop": ""},
    {"max_tokens": 10**12}, {"seed": -(2**63)}, {"top_p": 1e-30}, {"temperature": 1e-30}, {"min_p": 1.0},
    {"repetition_penalty": 1e30}, {"stop_token_ids": [10**9]}, {"echo": True, "logprobs": 20, "prompt": [5] * 200},
])
def test_extreme_but_valid_values_are_served(http, extra):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, **extra}
    assert http.post("/v1/completions", json=body).status_code == 200
    assert http.get("/health").status_code == 200


def test_unknown_fields_are_ignored(http):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "some_future_field": {"x": 1}, "suffix": None}
    assert http.post("/v1/completions", json=body).status_code == 200


def test_nested_validation_paths_read_well():
    message, param = describe_validation_errors(
        [{"type": "literal_error", "loc": ("body", "messages", 2, "role"), "msg": "Input should be 'user'"}])
    assert (message, param) == ("messages[2].role: Input should be 'user'", "messages")
