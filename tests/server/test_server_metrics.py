"""``/metrics`` after a known workload, in one process and across two processes that share
``PROMETHEUS_MULTIPROC_DIR``; the periodic log line."""

from __future__ import annotations

import time

import httpx
import pytest
from conftest import MODEL, Server
from prometheus_client.parser import text_string_to_metric_families

# What the issue asks for; each name as the exposition shows it.
REQUIRED = [
    "tokenmill:num_requests_running", "tokenmill:num_requests_waiting", "tokenmill:kv_cache_usage_perc",
    "tokenmill:prefix_cache_queries", "tokenmill:prefix_cache_hits", "tokenmill:num_preemptions",
    "tokenmill:prompt_tokens", "tokenmill:generation_tokens", "tokenmill:request_success",
    "tokenmill:num_aborted_requests", "tokenmill:num_requests_rejected",
    "tokenmill:time_to_first_token_seconds", "tokenmill:inter_token_latency_seconds",
    "tokenmill:e2e_request_latency_seconds", "tokenmill:request_queue_time_seconds",
    "tokenmill:request_prefill_time_seconds", "tokenmill:request_decode_time_seconds",
    "tokenmill:request_prompt_tokens", "tokenmill:request_generation_tokens", "tokenmill:iteration_tokens_total",
    "tokenmill:spec_decode_num_draft_tokens", "tokenmill:spec_decode_num_accepted_tokens",
]


def scrape(server: Server) -> tuple[set[str], dict[tuple[str, tuple], float]]:
    """Family names, and each sample by (name, labels but the model name)."""
    response = httpx.get(f"{server.url}/metrics", timeout=10)  # no key needed, as for a Prometheus scraper
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    families = list(text_string_to_metric_families(response.text))
    samples = {}
    for family in families:
        for s in family.samples:
            if s.labels.get("model_name", MODEL) != MODEL:
                raise AssertionError(f"unexpected model_name label in {s}")
            samples[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "pid"))))] \
                = s.value
    return {f.name for f in families}, samples


def delta(after: dict, before: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def _post_completion(server: Server, prompt: list[int], max_tokens: int) -> dict:
    response = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()["usage"]


@pytest.fixture(scope="module")
def pair(tiny_args, tmp_path_factory):
    """Two server processes sharing one multiprocess folder, logging stats every 0.2 s."""
    folder = tmp_path_factory.mktemp("prometheus-multiproc")
    env = {"PROMETHEUS_MULTIPROC_DIR": str(folder)}
    servers = [Server(tiny_args("--log-stats-interval", "0.2"), tmp_path_factory.mktemp("serve") / "server.log", env)
               for _ in range(2)]
    yield servers
    for server in servers:
        server.stop()


def test_metrics_count_a_known_workload(pair):
    a, _ = pair
    names, before = scrape(a)
    prompts = [[5, 6, 7], [8, 9], [10]]
    usages = [_post_completion(a, p, 4) for p in prompts]
    with httpx.stream("POST", f"{a.url}/v1/chat/completions", timeout=60, json={
            "model": MODEL, "max_tokens": 3, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "messages": [{"role": "user", "content": "hi"}]}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    import json

    usages.append(json.loads(lines[-1].removeprefix("data: "))["usage"])
    a.wait_idle()
    names, after = scrape(a)
    assert set(REQUIRED) <= names, set(REQUIRED) - names
    assert delta(after, before, "tokenmill:request_success_total", finished_reason="length") == 4
    for reason in ("stop", "abort", "error", "timeout"):
        assert delta(after, before, "tokenmill:request_success_total", finished_reason=reason) == 0
    assert delta(after, before, "tokenmill:num_aborted_requests_total") == 0
    prompt_tokens = sum(u["prompt_tokens"] for u in usages)
    assert delta(after, before, "tokenmill:prompt_tokens_total") == prompt_tokens
    assert delta(after, before, "tokenmill:generation_tokens_total") == 3 * 4 + 3
    assert delta(after, before, "tokenmill:request_prompt_tokens_sum") == prompt_tokens
    assert delta(after, before, "tokenmill:request_generation_tokens_sum") == 15
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                      "request_prefill_time_seconds", "request_decode_time_seconds"):
        assert delta(after, before, f"tokenmill:{histogram}_count") == 4, histogram
    assert delta(after, before, "tokenmill:inter_token_latency_seconds_count") == 3 * 3 + 2
    assert delta(after, before, "tokenmill:iteration_tokens_total_sum") == prompt_tokens + 15 - 4
    assert delta(after, before, "tokenmill:spec_decode_num_draft_tokens_total") == 0
    assert after[("tokenmill:num_requests_running", ())] == 0
    assert after[("tokenmill:kv_cache_usage_perc", ())] == 0
    for reason in ("max_queued_requests", "max_queued_tokens", "shutting_down"):
        assert after[("tokenmill:num_requests_rejected_total", (("reason", reason),))] == 0


def test_every_process_sees_the_sum_of_all_processes(pair):
    a, b = pair
    _, before_a = scrape(a)
    _post_completion(a, [5, 6], 2)
    for prompt in ([7], [8, 9]):
        _post_completion(b, prompt, 3)
    a.wait_idle(), b.wait_idle()
    (_, after_a), (_, after_b) = scrape(a), scrape(b)
    assert after_a == after_b  # one merged view, whichever process is scraped
    assert delta(after_a, before_a, "tokenmill:request_success_total", finished_reason="length") == 3
    assert delta(after_a, before_a, "tokenmill:generation_tokens_total") == 2 + 2 * 3
    assert after_a[("tokenmill:num_requests_running", ())] == 0


def test_the_server_logs_a_stats_line(pair):
    a, _ = pair
    _post_completion(a, [5, 6], 8)
    time.sleep(0.3)
    _post_completion(a, [5, 6], 8)  # the line is written by the step after the interval
    deadline = time.monotonic() + 10
    while "generation throughput" not in a.log():
        assert time.monotonic() < deadline, a.log()
        time.sleep(0.1)
    line = next(line for line in a.log().splitlines() if "generation throughput" in line)
    for part in ("prompt throughput", "running:", "waiting:", "KV cache usage", "prefix cache hit rate"):
        assert part in line, line


def test_single_process_metrics_need_no_key_and_include_the_process(server):
    response = httpx.get(f"{server.url}/metrics", timeout=10)
    assert response.status_code == 200
    assert "tokenmill:request_success_total" in response.text and "process_resident_memory_bytes" in response.text


def test_metrics_and_the_log_line_can_be_switched_off(start_server, tiny_args):
    quiet = start_server(tiny_args("--disable-metrics", "--disable-log-stats", "--log-stats-interval", "0.01"))
    assert httpx.get(f"{quiet.url}/metrics").status_code == 404
    _post_completion(quiet, [5, 6], 4)
    _post_completion(quiet, [5, 6], 4)
    assert "generation throughput" not in quiet.log()
