"""``tokenmill serve --tensor-parallel-size 2`` through the openai client: the same answers as one rank.

Two real servers on 127.0.0.1 (one rank, and two worker processes over gloo) get the same
greedy chat, completion and streamed requests; their texts, token counts and logprobs agree.
A worker SIGKILLed under a third server turns ``/health`` to 503.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
from conftest import API_KEY, MODEL

QUESTIONS = [[{"role": "user", "content": text}] for text in
             ("What is the capital of France?", "Count to five.", "hi")]
PROMPTS = ["The quick brown fox", "Once upon a time", "1 2 3 4"]
CHAT = dict(model=MODEL, temperature=0, max_completion_tokens=16, logprobs=True, top_logprobs=2,
            extra_body={"ignore_eos": True})
COMPLETION = dict(model=MODEL, temperature=0, max_tokens=16, logprobs=2, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def tp_client(start_server, tiny_args) -> openai.OpenAI:
    server = start_server(tiny_args("--tensor-parallel-size", "2"), env={"TOKENMILL_API_KEY": API_KEY})
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _chat(client: openai.OpenAI, messages: list[dict]) -> tuple[str, list[str], list[float], int]:
    out = client.chat.completions.create(messages=messages, **CHAT)
    content = out.choices[0].logprobs.content
    return (out.choices[0].message.content, [t.token for t in content], [t.logprob for t in content],
            out.usage.completion_tokens)


def test_chat_equals_one_rank(client, tp_client):
    for messages in QUESTIONS:
        text, tokens, logprobs, count = _chat(client, messages)
        tp_text, tp_tokens, tp_logprobs, tp_count = _chat(tp_client, messages)
        assert (tp_text, tp_tokens, tp_count) == (text, tokens, count) and count == 16
        assert tp_logprobs == pytest.approx(logprobs, abs=1e-4)


def test_batched_completions_equal_one_rank(client, tp_client):
    """One request of several prompts: the two ranks decode them as one batch."""
    one = client.completions.create(prompt=PROMPTS, **COMPLETION)
    two = tp_client.completions.create(prompt=PROMPTS, **COMPLETION)
    assert [c.text for c in two.choices] == [c.text for c in one.choices]
    assert [c.logprobs.tokens for c in two.choices] == [c.logprobs.tokens for c in one.choices]
    for a, b in zip(one.choices, two.choices, strict=True):
        assert b.logprobs.token_logprobs == pytest.approx(a.logprobs.token_logprobs, abs=1e-4)
    assert two.usage.model_dump() == one.usage.model_dump()


def test_streams_equal_one_rank(client, tp_client):
    whole = client.chat.completions.create(messages=QUESTIONS[0], **CHAT).choices[0].message.content
    chunks = tp_client.chat.completions.create(messages=QUESTIONS[0], stream=True, **CHAT)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    text = client.completions.create(prompt=PROMPTS[1], **COMPLETION).choices[0].text
    streamed = tp_client.completions.create(prompt=PROMPTS[1], stream=True, **COMPLETION)
    assert "".join(c.choices[0].text for c in streamed) == text


def _worker_pids(server_pid: int) -> list[int]:
    """The server's spawned worker processes (children running multiprocessing's spawn entry)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rpartition(")")[2].split()[1]) == server_pid and b"spawn_main" in cmdline:
            pids.append(int(entry.name))
    return sorted(pids)


def test_a_killed_worker_turns_health_to_503(start_server, tiny_args):
    server = start_server(tiny_args("--tensor-parallel-size", "2", "--served-model-name", "tp-kill"))
    pids = _worker_pids(server.process.pid)
    assert len(pids) >= 2, pids
    os.kill(pids[-1], signal.SIGKILL)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.APIError):  # the step that finds the rank dead fails the request
        client.completions.create(model="tp-kill", prompt="hello", max_tokens=8)
    deadline = time.monotonic() + 30
    while httpx.get(f"{server.url}/health", timeout=5).status_code != 503 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 503
