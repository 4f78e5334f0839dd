"""Request lifecycle over HTTP: timeouts, admission control (429), a stuck loop, per-request
failures, an engine failure, readiness, and the SIGTERM drain.

Faults come from the fault-injection model plugin (tests/plugins/tokenmill-fault-injection):
a prompt holding one of its poison token ids makes the real forward raise, hang or return NaN.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from conftest import MODEL, Server
from fault_model import NAN_TOKEN, RAISE_TOKEN, SLEEP_S, SLEEP_TOKEN

LONG = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 240, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def lc(start_server, tiny_args):
    """One sequence slot (so a blocker makes later requests wait), two queued requests at most, no key."""
    return start_server(tiny_args("--max-num-seqs", "1", "--max-queued-requests", "2"))


@pytest.fixture(scope="module")
def fault(start_server, fault_model_path):
    return start_server([str(fault_model_path), "--served-model-name", MODEL, "--max-model-len", "256",
                         "--kv-cache-memory", "16MiB", "--dtype", "float32", "--health-stall-timeout", "1"])


def sse_events(lines) -> list:
    """The JSON events of an event stream (``[DONE]`` as the string)."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def rejected(server: Server, reason: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "tokenmill:num_requests_rejected_total" and s.labels["reason"] == reason)


def _wait_for(condition, timeout_s: float = 30, interval_s: float = 0.02) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(interval_s)


def _assert_clean(server: Server) -> None:
    stats = server.wait_idle()
    assert stats["running"] == stats["waiting"] == stats["unfinished"] == stats["in_flight"] == 0, stats
    assert stats["queued"] == stats["queued_tokens"] == stats["deadlines"] == 0, stats
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], stats


# -- timeouts ------------------------------------------------------------------------------------
def test_a_timeout_ends_the_request_with_finish_reason_timeout(lc):
    """Behind a blocker on the only slot, a request with a 0.3 s timeout ends without a token:
    non-streamed it is a 200 whose choice says finish_reason "timeout"; streamed, its last chunk does."""
    client = openai.OpenAI(base_url=f"{lc.url}/v1", api_key="none", max_retries=0, timeout=30)
    with httpx.Client(base_url=lc.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json={**LONG, "n": 16, "stream": True}) as blocker:
            lines = blocker.iter_lines()  # kept: a dropped iterator closes the response
            assert next(lines).startswith("data: {")
            start = time.monotonic()
            plain = client.completions.create(model=MODEL, prompt="hello", max_tokens=50,
                                              extra_body={"timeout": 0.3})
            with http.stream("POST", "/v1/chat/completions", json={
                    "model": MODEL, "stream": True, "timeout": 0.3, "max_tokens": 50,
                    "messages": [{"role": "user", "content": "hi"}]}) as streamed:
                events = sse_events(streamed.iter_lines())
            elapsed = time.monotonic() - start
    assert plain.choices[0].finish_reason == "timeout" and plain.choices[0].text == ""
    assert plain.usage.completion_tokens == 0
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "timeout"
    assert elapsed < 10
    _assert_clean(lc)


def test_a_bad_timeout_is_a_400(lc):
    for value in (0, -1, "soon"):
        response = httpx.post(f"{lc.url}/v1/completions", json={"model": MODEL, "prompt": "a", "timeout": value})
        assert response.status_code == 400 and response.json()["error"]["param"] == "timeout"


# -- admission control ------------------------------------------------------------------------------
def test_a_full_queue_answers_429_with_retry_after(lc):
    """The slot is taken and two requests wait for it: the third is refused, and counted."""
    before = rejected(lc, "max_queued_requests")

    async def scenario():
        async with httpx.AsyncClient(base_url=lc.url, timeout=60) as http:
            async with http.stream("POST", "/v1/completions", json={**LONG, "n": 16, "stream": True}) as blocker:
                lines = blocker.aiter_lines()  # kept: a dropped iterator closes the response
                await anext(lines)
                waiting = [asyncio.ensure_future(http.post("/v1/completions", json={
                    "model": MODEL, "prompt": f"queued {i}", "max_tokens": 2})) for i in range(2)]
                deadline = time.monotonic() + 30
                while (await http.get("/engine/stats")).json()["queued"] < 2:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.02)
                refused = await http.post("/v1/chat/completions", json={
                    "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
            return refused, await asyncio.gather(*waiting)  # the blocker left: the queue moves again

    refused, waited = asyncio.run(scenario())
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    error = refused.json()["error"]
    assert error["code"] == "queue_full" and error["type"] == "rate_limit_error" and "queued" in error["message"]
    assert [r.status_code for r in waited] == [200, 200]
    assert rejected(lc, "max_queued_requests") == before + 1
    _assert_clean(lc)


def test_ready_and_health_when_serving(lc):
    assert httpx.get(f"{lc.url}/ready").json() == {"status": "ready"}
    assert httpx.get(f"{lc.url}/health").status_code == 200


# -- faults ------------------------------------------------------------------------------------------
def test_a_stuck_engine_loop_turns_health_red_until_it_moves_again(fault):
    """A forward that sleeps 4 s (a hung step) ages the heartbeat past the 1 s threshold."""
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(httpx.post, f"{fault.url}/v1/completions", timeout=60,
                           json={"model": MODEL, "prompt": [5, SLEEP_TOKEN], "max_tokens": 2})
        start = time.monotonic()
        _wait_for(lambda: httpx.get(f"{fault.url}/health").status_code == 503, timeout_s=SLEEP_S, interval_s=0.1)
        stalled = httpx.get(f"{fault.url}/health")
        assert time.monotonic() - start < SLEEP_S
        assert slow.result().status_code == 200
    if stalled.status_code == 503:  # (unless the step ended between the two reads)
        assert stalled.json()["error"]["code"] == "engine_stalled"
    assert httpx.get(f"{fault.url}/health").status_code == 200


def test_nan_logits_fail_only_that_request_with_a_500(fault):
    def post(prompt):
        return httpx.post(f"{fault.url}/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": prompt, "max_tokens": 6, "ignore_eos": True})

    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(post, [[5, 6], [7, 8, NAN_TOKEN], [9], "hello there"]))
    bad = responses[1]
    assert bad.status_code == 500 and "non-finite logits" in bad.json()["error"]["message"]
    for good in responses[:1] + responses[2:]:
        assert good.status_code == 200 and good.json()["choices"][0]["finish_reason"] == "length"
    assert httpx.get(f"{fault.url}/health").status_code == 200
    _assert_clean(fault)


def test_an_engine_failure_fails_every_pending_request_fast_and_turns_health_red(fault):
    """Last in this module: the fault server's engine dies here."""
    async def scenario():
        async with httpx.AsyncClient(base_url=fault.url, timeout=60) as http:
            async def streamed():
                async with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response:
                    return response.status_code, sse_events([line async for line in response.aiter_lines()])

            streams = [asyncio.ensure_future(streamed()) for _ in range(2)]
            plain = [asyncio.ensure_future(http.post("/v1/chat/completions", json={
                "model": MODEL, "max_tokens": 240, "ignore_eos": True,
                "messages": [{"role": "user", "content": f"hi {i}"}]})) for i in range(2)]
            deadline = time.monotonic() + 30
            while (await http.get("/engine/stats")).json()["running"] < 4:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            start = time.monotonic()
            poisoned = await http.post("/v1/completions", json={"model": MODEL, "prompt": [5, RAISE_TOKEN]})
            others = await asyncio.gather(*plain, *streams)
            return poisoned, others, time.monotonic() - start

    poisoned, (*plain, stream_a, stream_b), elapsed = asyncio.run(scenario())
    assert poisoned.status_code == 500
    assert poisoned.json()["error"]["code"] == "engine_dead" and "poison token" in poisoned.json()["error"]["message"]
    for response in plain:
        assert response.status_code == 500 and response.json()["error"]["code"] == "engine_dead"
    for status, events in (stream_a, stream_b):  # the 200 was sent: the error comes in-band
        assert status == 200 and events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_dead"
    assert elapsed < 10
    health = httpx.get(f"{fault.url}/health")
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
    assert httpx.get(f"{fault.url}/ready").status_code == 503
    after = httpx.post(f"{fault.url}/v1/completions", json={"model": MODEL, "prompt": "hello"})
    assert after.status_code == 500 and after.json()["error"]["code"] == "engine_dead"


# -- SIGTERM ---------------------------------------------------------------------------------------
def test_sigterm_drains_running_requests_aborts_the_rest_and_exits_0(tiny_args, tmp_path):
    """Two slots: a short request finishes during the drain; a 128-sample one cannot finish within
    --shutdown-timeout and is aborted with finish_reason "abort" and a message; meanwhile new requests
    get a 503 and /ready turns 503, /health stays 200; the process exits with 0."""
    server = Server(tiny_args("--max-num-seqs", "2", "--shutdown-timeout", "5"), tmp_path / "server.log")
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http, ThreadPoolExecutor(2) as pool:
            def stream(body):
                with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                    lines = response.iter_lines()
                    first = next(lines)
                    started.append(first)
                    return sse_events([first, *lines])

            started: list[str] = []
            short = pool.submit(stream, {**LONG, "max_tokens": 60})
            _wait_for(lambda: len(started) == 1)
            long = pool.submit(stream, {**LONG, "n": 128})  # 128 x 240 tokens, two at a time
            _wait_for(lambda: len(started) == 2)
            server.process.send_signal(signal.SIGTERM)
            _wait_for(lambda: http.get("/ready").status_code == 503, timeout_s=5)
            refused = http.post("/v1/completions", json={"model": MODEL, "prompt": "late"})
            assert http.get("/health").status_code == 200  # alive, only not ready
            short_events, long_events = short.result(timeout=30), long.result(timeout=30)
        exit_code = server.process.wait(timeout=30)
    finally:
        server.stop()
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
    finishes = [c["finish_reason"] for e in short_events[:-1] for c in e.get("choices", []) if c["finish_reason"]]
    assert finishes == ["length"]
    long_finishes = {c["finish_reason"] for e in long_events[:-2] for c in e.get("choices", []) if c["finish_reason"]}
    assert "abort" in long_finishes and long_finishes <= {"abort", "length"}
    error = long_events[-2]["error"]
    assert error["code"] == "request_aborted" and "shutting down" in error["message"]
    assert exit_code == 0, server.log()
    log = server.log()
    assert "aborted 1 request(s)" in log, log
