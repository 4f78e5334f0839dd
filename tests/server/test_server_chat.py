"""/v1/chat/completions through the openai client: template, roles, streaming, n, logprobs."""

from __future__ import annotations

import math

from conftest import MODEL

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = dict(model=MODEL, temperature=0, max_completion_tokens=20, extra_body={"ignore_eos": True})


def _streamed(client, **kwargs):
    texts: dict[int, str] = {}
    roles: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        assert chunk.object == "chat.completion.chunk"
        usage = chunk.usage or usage
        for choice in chunk.choices:
            if choice.delta.role:
                roles[choice.index] = choice.delta.role
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    return texts, roles, finish, usage


def test_chat_basic(client, http):
    out = client.chat.completions.create(messages=QUESTION, **GREEDY)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-") and out.model == MODEL
    (choice,) = out.choices
    assert choice.message.role == "assistant" and choice.message.content and choice.finish_reason == "length"
    rendered = http.post("/tokenize", json={"messages": QUESTION}).json()
    assert out.usage.prompt_tokens == rendered["count"] and out.usage.completion_tokens == 20


def test_prompt_is_the_chat_template(client):
    """The tiny model's template renders `<s>role: content</s>...<s>assistant:`; the same text sent to
    /v1/completions (without a second BOS) must give the same greedy answer."""
    chat = client.chat.completions.create(messages=QUESTION, **GREEDY).choices[0].message.content
    prompt = "<s>user: What is the capital of France?</s><s>assistant:"
    completion = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=20,
                                           extra_body={"ignore_eos": True}).choices[0].text
    assert chat == completion


def test_stream_deltas_sum_to_the_greedy_result(client):
    whole = client.chat.completions.create(messages=QUESTION, **GREEDY)
    texts, roles, finish, usage = _streamed(client, messages=QUESTION, stream_options={"include_usage": True},
                                            **GREEDY)
    assert texts == {0: whole.choices[0].message.content}
    assert roles == {0: "assistant"} and finish == {0: "length"}
    assert usage.model_dump() == whole.usage.model_dump()


def test_n_samples(client):
    kwargs = dict(model=MODEL, messages=QUESTION, n=2, temperature=1.0, seed=11, max_tokens=12)
    out = client.chat.completions.create(**kwargs)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].message.content != out.choices[1].message.content  # each sample has its own seed
    texts, roles, finish, _ = _streamed(client, **kwargs)
    assert texts == {c.index: c.message.content for c in out.choices}
    assert roles == {0: "assistant", 1: "assistant"} and set(finish) == {0, 1}


def test_logprobs_and_top_logprobs(client):
    out = client.chat.completions.create(messages=QUESTION, logprobs=True, top_logprobs=3, **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == 20
    for entry in content:
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert math.isclose(entry.logprob, values[0], abs_tol=1e-5)  # greedy: the chosen token is the best
        assert entry.bytes == list(entry.token.encode())
    plain = client.chat.completions.create(messages=QUESTION, logprobs=True, **GREEDY)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)
    assert client.chat.completions.create(messages=QUESTION, **GREEDY).choices[0].logprobs is None


def test_roles_and_content_parts(client):
    messages = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": [{"type": "text", "text": "What is the capital "}, {"type": "text",
                                                                                         "text": "of France?"}]},
        {"role": "assistant", "content": "Paris."},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        {"role": "user", "content": "Thanks"},
    ]
    out = client.chat.completions.create(messages=messages, **GREEDY)
    assert out.choices[0].message.content


def test_content_parts_join_like_a_string(client, http):
    as_parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital "},
                                             {"type": "text", "text": "of France?"}]}]
    assert (http.post("/tokenize", json={"messages": as_parts}).json()
            == http.post("/tokenize", json={"messages": QUESTION}).json())


def test_continue_final_message(client, http):
    messages = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    tokens = http.post("/tokenize", json={"messages": messages, "continue_final_message": True}).json()["tokens"]
    text = http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert text.endswith("assistant: The capital of France is")  # no closing </s>, no new turn
    out = client.chat.completions.create(messages=messages, extra_body={"continue_final_message": True,
                                                                        "ignore_eos": True},
                                         model=MODEL, temperature=0, max_tokens=5)
    assert out.usage.prompt_tokens == len(tokens)


def test_add_generation_prompt_false(http):
    with_prompt = http.post("/tokenize", json={"messages": QUESTION}).json()["count"]
    without = http.post("/tokenize", json={"messages": QUESTION, "add_generation_prompt": False}).json()["count"]
    assert without < with_prompt


def test_request_chat_template_overrides(client, http):
    template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    tokens = http.post("/tokenize", json={"messages": QUESTION, "chat_template": template}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": tokens}).json()["prompt"] == "What is the capital of France?\n"
    out = client.chat.completions.create(messages=QUESTION, extra_body={"chat_template": template}, model=MODEL,
                                         max_tokens=2)
    assert out.usage.prompt_tokens == len(tokens)
