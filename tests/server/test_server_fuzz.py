"""Fuzzed request bodies: whatever a client sends, the answer is a 2xx or a 4xx in OpenAI's error
shape, never a 5xx (nor a 5xx error inside a 200 event stream), and the server keeps answering.

Bodies come from hypothesis: each route's known fields with values that are sometimes right and
often wrong (types, ranges, NaN and infinities, huge integers, lone surrogates, Jinja that fails),
plus arbitrary JSON and bytes that are not JSON. The server bounds the cost of the bodies that are
valid: a short context, a --request-timeout, few sequences. Examples are derandomized: the same
bodies every run, bounded in number.
"""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import MODEL
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

EXAMPLES = 80

# -- values --------------------------------------------------------------------------------------
floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, 0.5, 1.0, 2.0, -1.0, 1e308])
ints = st.integers(min_value=-(2**70), max_value=2**70) | st.integers(min_value=-3, max_value=300)
texts = st.text(max_size=24) | st.sampled_from(["", " ", "hello", "\ud800", "\x00", "{{ 1/0 }}", "</s>"])
scalars = st.none() | st.booleans() | ints | floats | texts
junk = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
                    max_leaves=8)
token_ids = st.lists(st.integers(min_value=-5, max_value=400) | ints, max_size=8)
prompts = (texts | token_ids | st.lists(texts, max_size=3) | st.lists(token_ids, max_size=3) | junk)
stops = texts | st.lists(texts, max_size=6) | junk


def wild(fields: dict[str, st.SearchStrategy]) -> dict[str, st.SearchStrategy]:
    """The same fields, each sometimes anything at all."""
    return {name: strategy | junk for name, strategy in fields.items()}


# Plausible values: right types, ranges a little past the limits on both sides.
SAMPLING = {
    "model": st.sampled_from([MODEL, "no-such-model", ""]),
    "max_tokens": st.integers(min_value=-2, max_value=300) | st.none(),
    "n": st.integers(min_value=-1, max_value=6) | st.sampled_from([128, 129]),
    "temperature": floats, "top_p": floats, "top_k": st.integers(-3, 500), "min_p": floats,
    "presence_penalty": floats, "frequency_penalty": floats, "repetition_penalty": floats, "seed": ints,
    "stop": stops, "stop_token_ids": token_ids,
    "logit_bias": st.dictionaries(texts | st.integers(-2, 400).map(str), floats, max_size=3),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "min_tokens": st.integers(-2, 300), "ignore_eos": st.booleans(), "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(), "priority": ints, "timeout": floats, "user": texts,
    "structured_outputs": st.fixed_dictionaries({}, optional={
        "regex": st.sampled_from(["[0-9]+", "(", "a{2,3}"]) | texts, "choice": st.lists(texts, max_size=3),
        "json": st.sampled_from([{"type": "object"}, {"type": "integer"}, {"type": "nope"}]) | junk}),
}
COMPLETION = {**SAMPLING, "prompt": prompts, "logprobs": st.integers(-2, 25), "echo": st.booleans(),
              "suffix": texts}
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "x"])},
    optional={"content": texts | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"])},
                                                                optional={"text": texts}), max_size=2),
              "name": texts, "tool_call_id": texts, "tool_calls": junk})
messages = st.lists(message | junk, max_size=4)
CHAT = {**SAMPLING, "messages": messages, "max_completion_tokens": st.integers(-2, 300),
        "logprobs": st.booleans(), "top_logprobs": st.integers(-2, 25),
        "chat_template": st.sampled_from(["{{ messages }}", "{% for %}", "{{ 1/0 }}", "{{ raise('x') }}"]),
        "add_generation_prompt": st.booleans(), "continue_final_message": st.booleans(),
        "tools": junk, "tool_choice": st.sampled_from(["none", "auto", "required"]) | junk,
        "response_format": st.fixed_dictionaries({}, optional={
            "type": st.sampled_from(["text", "json_object", "json_schema", "xml"]), "json_schema": junk})}
EMBEDDING = {"model": SAMPLING["model"], "input": prompts, "encoding_format": st.sampled_from(["float", "base64"]),
             "dimensions": ints, "pooling": st.sampled_from(["last", "mean", "max"])}
TOKENIZE = {"model": SAMPLING["model"], "prompt": texts, "messages": messages, "add_special_tokens": st.booleans()}
DETOKENIZE = {"model": SAMPLING["model"], "tokens": token_ids}
VALID_BASE = {
    "/v1/completions": {"model": st.just(MODEL), "prompt": st.sampled_from(["hello", [5, 6, 7], ["a", "b"]])},
    "/v1/chat/completions": {"model": st.just(MODEL), "messages": st.just([{"role": "user", "content": "hi"}])},
    "/v1/embeddings": {"model": st.just(MODEL), "input": st.sampled_from(["hello", [5, 6]])},
    "/tokenize": {"prompt": st.just("hello")},
    "/detokenize": {"tokens": st.just([5, 6])},
}


# Values in range: bodies that reach the engine and exercise generation (stops, logprobs, n, streams).
clean_text = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=8)
IN_RANGE = {
    "max_tokens": st.integers(1, 40), "n": st.integers(1, 4), "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 50), "min_p": st.floats(0, 1),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2), "seed": st.integers(0, 2**32), "stop": st.lists(clean_text, max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 383), max_size=3), "ignore_eos": st.booleans(),
    "logit_bias": st.dictionaries(st.integers(0, 383).map(str), st.floats(-100, 100), max_size=3),
    "stream": st.booleans(), "min_tokens": st.integers(0, 2), "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(), "timeout": st.floats(0.01, 3), "priority": st.integers(-5, 5),
    "structured_outputs": st.sampled_from([{"choice": ["yes", "no"]}, {"regex": "[0-9]{1,3}"}]),
}
IN_RANGE_BY_PATH = {
    "/v1/completions": {**IN_RANGE, "logprobs": st.integers(0, 5), "echo": st.booleans()},
    "/v1/chat/completions": {**IN_RANGE, "logprobs": st.booleans(), "max_completion_tokens": st.integers(1, 40)},
    "/v1/embeddings": {"pooling": st.sampled_from(["last", "mean"]),
                       "encoding_format": st.sampled_from(["float", "base64"])},
    "/tokenize": {"add_special_tokens": st.booleans()},
    "/detokenize": {},
}


def bodies(path: str, fields: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """A valid request with extras in range, or with plausible extras, any mix of the fields
    (each maybe wild), or anything."""
    base = VALID_BASE[path]
    extras = {name: strategy for name, strategy in fields.items() if name not in base}
    return (st.fixed_dictionaries(base, optional=IN_RANGE_BY_PATH[path])
            | st.fixed_dictionaries(base, optional=extras)
            | st.fixed_dictionaries({}, optional=wild(fields))
            | junk)


# -- the server and the check ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fuzzed(start_server, tiny_args):
    return start_server(tiny_args("--max-model-len", "64", "--request-timeout", "2", "--max-num-seqs", "16"))


@pytest.fixture(scope="module")
def http(fuzzed):
    with httpx.Client(base_url=fuzzed.url, timeout=60) as client:
        yield client


def check(http: httpx.Client, path: str, content: bytes) -> None:
    with http.stream("POST", path, content=content, headers={"Content-Type": "application/json"}) as response:
        raw = response.read()
    assert response.status_code < 500, (path, content[:500], response.status_code, raw[:500])
    if response.status_code >= 400:
        error = json.loads(raw)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] != "server_error", error
    elif response.headers.get("content-type", "").startswith("text/event-stream"):
        for line in raw.decode().splitlines():
            if line.startswith("data: {"):
                event = json.loads(line.removeprefix("data: "))
                assert event.get("error", {}).get("type") != "server_error", (path, content[:500], event)


def encode(body: object) -> bytes:
    return json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")


FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@FUZZ
@given(body=bodies("/v1/completions", COMPLETION))
def test_fuzzed_completions(http, body):
    check(http, "/v1/completions", encode(body))


@FUZZ
@given(body=bodies("/v1/chat/completions", CHAT))
def test_fuzzed_chat_completions(http, body):
    check(http, "/v1/chat/completions", encode(body))


@settings(FUZZ, max_examples=EXAMPLES // 2)
@given(path=st.sampled_from(["/v1/embeddings", "/tokenize", "/detokenize"]), data=st.data())
def test_fuzzed_other_routes(http, path, data):
    fields = {"/v1/embeddings": EMBEDDING, "/tokenize": TOKENIZE, "/detokenize": DETOKENIZE}[path]
    check(http, path, encode(data.draw(bodies(path, fields))))


@settings(FUZZ, max_examples=EXAMPLES // 2)
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize"]),
       content=st.binary(max_size=64) | st.sampled_from([b"", b"{", b"[]", b"null", b'{"prompt": NaN}',
                                                          b'{"messages": [}', b"\xff\xfe"]))
def test_bytes_that_are_not_json(http, path, content):
    check(http, path, content)


def test_the_server_is_healthy_and_clean_after_the_fuzzing(fuzzed, http):
    stats = fuzzed.wait_idle()
    assert stats["running"] == stats["waiting"] == stats["unfinished"] == stats["in_flight"] == 0, stats
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], stats
    assert http.get("/health").status_code == 200
    answer = http.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 3})
    assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"] in ("length", "stop")
