"""Clients that leave: mid-stream, before their first token, before a whole answer.

A server with one sequence slot makes "before the first token" certain: a
second request waits in the queue while a long one runs. Each test checks the
engine afterwards: no request left, every KV block free.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from conftest import MODEL

# With one slot, n samples run one after another: n * 240 tokens is long on any machine.
LONG = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 240, "temperature": 0, "ignore_eos": True}
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"


@pytest.fixture(scope="module")
def single_seq(start_server, tiny_args, tmp_path_factory):
    """One sequence at a time, a server-wide chat template from a file, and no API key."""
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    return start_server(tiny_args("--max-num-seqs", "1", "--chat-template", str(template)))


def _assert_clean(server, disconnects_before: int, disconnects: int = 1) -> None:
    stats = server.wait_idle()
    assert stats["running"] == stats["waiting"] == stats["unfinished"] == 0, stats
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], stats
    assert stats["client_disconnects"] == disconnects_before + disconnects, stats


def test_mid_stream_disconnect_aborts(single_seq):
    before = single_seq.stats()["client_disconnects"]
    with httpx.Client(base_url=single_seq.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json={**LONG, "n": 4, "stream": True}) as response:
            assert response.status_code == 200
            lines = response.iter_lines()  # kept: a dropped iterator closes the response
            assert next(lines).startswith("data: {")
            stats = single_seq.stats()
            assert stats["running"] == 1 and stats["client_disconnects"] == before, stats  # generating, connected
    _assert_clean(single_seq, before)


def test_disconnect_before_the_first_token_aborts(single_seq):
    """A blocker of 16 long samples holds the only slot (FCFS), so a chat request queued behind it
    cannot get a token before its client gives up."""
    before = single_seq.stats()["client_disconnects"]
    with httpx.Client(base_url=single_seq.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json={**LONG, "n": 16, "stream": True}) as blocker:
            lines = blocker.iter_lines()
            assert next(lines).startswith("data: {")
            with pytest.raises(httpx.ReadTimeout):
                http.post("/v1/chat/completions", timeout=0.3, json={
                    "model": MODEL, "stream": True, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
            _wait_for(lambda: single_seq.stats()["client_disconnects"] == before + 1)
            stats = single_seq.stats()
            # only the blocker is left (not "running == 1": between two of its samples, which run
            # one after another in the one slot, none is running for an instant)
            assert stats["unfinished"] == 1, stats
    _assert_clean(single_seq, before, disconnects=2)


def test_non_streamed_disconnect_aborts(single_seq):
    before = single_seq.stats()["client_disconnects"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{single_seq.url}/v1/completions", json={**LONG, "n": 16}, timeout=0.3)
    _assert_clean(single_seq, before)


def test_server_chat_template_file_and_no_key(single_seq):
    client = openai.OpenAI(base_url=f"{single_seq.url}/v1", api_key="anything", max_retries=0)
    tokens = httpx.post(f"{single_seq.url}/tokenize",
                        json={"messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
    text = httpx.post(f"{single_seq.url}/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert text == "[user] hi\n[assistant]"
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert out.usage.prompt_tokens == len(tokens)


def _wait_for(condition, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
