"""A bounded load test on 127.0.0.1: 240 concurrent streaming requests, some of which the client
abandons mid-stream or before the first token, some of which time out on the server, more than
the admission queue takes (long requests hold every running slot until the first is refused). Afterwards every KV block is free, nothing is left in the engine, every
request got its full result or a clear answer, and the metrics add up:

    sum(request_success_total over finish reasons) + num_requests_rejected_total == requests sent

(each request here is one engine request: one prompt, n=1; a client that leaves counts as "abort").
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter

import httpx
import pytest
from conftest import MODEL
from test_server_metrics import delta, scrape

from tokenmill_cli.server.streaming import merge_streams

NUM_REQUESTS = 240
MAX_QUEUED = 100  # well under the 240-request burst
MAX_NUM_SEQS = 32
# Long requests that take every running slot before the burst comes, so that the burst can only
# queue and past MAX_QUEUED is refused however fast the engine drains (a fast engine finished the
# burst's short requests as quickly as they arrived, and nothing was ever refused). Released (the
# client leaves) at the first refusal.
BLOCKER_TOKENS = 220
KINDS = ["full"] * 8 + ["disconnect"] * 4 + ["give_up"] * 3 + ["timeout"] * 5


@pytest.fixture(scope="module")
def loaded(start_server, tiny_args):
    return start_server(tiny_args("--max-num-seqs", str(MAX_NUM_SEQS), "--max-queued-requests", str(MAX_QUEUED)))


async def _blocker(http: httpx.AsyncClient, i: int, started: asyncio.Queue, release: asyncio.Event) -> str:
    """Holds a running slot until ``release`` (then leaves: "abort") or its last token ("length")."""
    body = {"model": MODEL, "prompt": f"blocker {i}", "max_tokens": BLOCKER_TOKENS, "ignore_eos": True,
            "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        lines = response.aiter_lines()
        async for line in lines:
            if line.startswith("data: "):
                break
        started.put_nowait(i)
        async for line in lines:
            if release.is_set():
                return "left"
            if line == "data: [DONE]":
                return "complete"
    return "complete"


def _body(rng: random.Random, i: int, kind: str, max_tokens: int) -> tuple[str, dict]:
    common = {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
              "stream_options": {"include_usage": True}}
    if kind == "timeout":
        common["timeout"] = round(rng.uniform(0.05, 0.6), 3)
    if i % 2:
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": f"request {i}"}]}
    return "/v1/completions", {**common, "prompt": f"The quick brown fox {i}"}


async def _one(http: httpx.AsyncClient, rng: random.Random, i: int,
               release: asyncio.Event) -> tuple[str, str, dict]:
    """(kind, outcome, details): outcome is rejected, complete or left; anything else fails the test."""
    kind = rng.choice(KINDS)
    max_tokens = rng.randint(4, 16)
    path, body = _body(rng, i, kind, max_tokens)
    timeout = httpx.Timeout(60, read=rng.uniform(0.05, 0.5)) if kind == "give_up" else httpx.Timeout(60)
    leave_after = rng.randint(1, 3)
    try:
        async with http.stream("POST", path, json=body, timeout=timeout) as response:
            if response.status_code == 429:
                release.set()
                error = json.loads(await response.aread())["error"]
                assert error["code"] == "queue_full" and response.headers["retry-after"], error
                return kind, "rejected", {}
            assert response.status_code == 200, (response.status_code, await response.aread())
            events = []
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
                if kind == "disconnect" and len(events) >= leave_after and events[-1] != "[DONE]":
                    return kind, "left", {}
    except httpx.ReadTimeout:
        assert kind == "give_up"
        return kind, "left", {}
    assert events and events[-1] == "[DONE]", events[-3:]
    assert not any("error" in e for e in events if isinstance(e, dict)), events
    finishes = [c["finish_reason"] for e in events[:-1] for c in e.get("choices", []) if c.get("finish_reason")]
    usage = events[-2]["usage"]
    assert len(finishes) == 1, events
    if kind == "timeout":
        assert finishes[0] in ("timeout", "length") and usage["completion_tokens"] <= max_tokens
    else:
        assert finishes == ["length"] and usage["completion_tokens"] == max_tokens, (kind, events[-3:])
    return kind, "complete", {"finish": finishes[0]}


def test_a_slow_reader_holds_one_output_per_source():
    """The server's merge of engine streams keeps only each source's newest (cumulative) output,
    so a client that does not read makes memory grow by nothing, not by one output per step."""
    async def source(length: int):
        for i in range(length):
            yield list(range(i + 1))  # cumulative, like RequestOutputs
            await asyncio.sleep(0)

    async def scenario():
        merged = merge_streams([source(100), source(50)])
        first = await anext(merged)
        await asyncio.sleep(0.1)  # both sources run to their end meanwhile
        return first, [item async for item in merged]

    first, rest = asyncio.run(scenario())
    assert first == (0, [0])
    assert sorted((index, len(item)) for index, item in rest) == [(0, 100), (1, 50)]


def test_load_with_disconnects_timeouts_and_rejections_leaves_nothing_behind(loaded):
    _, before = scrape(loaded)
    rng = random.Random(1234)

    async def scenario():
        limits = httpx.Limits(max_connections=NUM_REQUESTS + MAX_NUM_SEQS + 10, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=loaded.url, limits=limits, timeout=60) as http:
            started: asyncio.Queue = asyncio.Queue()
            release = asyncio.Event()
            blockers = [asyncio.create_task(_blocker(http, i, started, release)) for i in range(MAX_NUM_SEQS)]
            for _ in range(MAX_NUM_SEQS):  # every slot taken before the burst
                await started.get()
            results = await asyncio.gather(*[_one(http, rng, i, release) for i in range(NUM_REQUESTS)])
            return results, await asyncio.gather(*blockers)

    start = time.monotonic()
    results, blocked = asyncio.run(asyncio.wait_for(scenario(), timeout=90))
    elapsed = time.monotonic() - start

    stats = loaded.wait_idle()
    deadline = time.monotonic() + 15
    while (stats["in_flight"] or stats["queued"] or stats["deadlines"]) and time.monotonic() < deadline:
        time.sleep(0.05)
        stats = loaded.stats()
    assert stats["running"] == stats["waiting"] == stats["unfinished"] == stats["in_flight"] == 0, stats
    assert stats["queued"] == stats["queued_tokens"] == stats["deadlines"] == 0, stats
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], stats

    _, after = scrape(loaded)
    finished = {reason: delta(after, before, "tokenmill:request_success_total", finished_reason=reason)
                for reason in ("stop", "length", "abort", "error", "timeout")}
    refused = sum(delta(after, before, "tokenmill:num_requests_rejected_total", reason=reason)
                  for reason in ("max_queued_requests", "max_queued_tokens"))
    outcomes = Counter(outcome for _, outcome, _ in results)
    finishes = Counter(details["finish"] for _, outcome, details in results if outcome == "complete")
    summary = (f"{elapsed:.1f} s; outcomes {dict(outcomes)}; blockers {dict(Counter(blocked))}; "
               f"engine finishes {finished}; refused {refused}")
    assert sum(finished.values()) + refused == NUM_REQUESTS + MAX_NUM_SEQS, summary
    assert finished["error"] == 0, summary
    assert outcomes["rejected"] <= refused, summary  # a client that gave up may never have read its 429
    assert outcomes["rejected"] > 0 and outcomes["left"] > 0 and finishes["timeout"] > 0, summary  # all exercised
    assert finished["length"] >= finishes["length"] + blocked.count("complete"), summary
    assert finished["timeout"] >= finishes["timeout"], summary
    assert delta(after, before, "tokenmill:num_aborted_requests_total") == finished["abort"] + finished["timeout"]
    assert httpx.get(f"{loaded.url}/health").status_code == 200
    print(summary)
