"""``tokenmill router`` over real ``tokenmill serve`` processes on 127.0.0.1: a prefill server
(a KV producer), a decode server (its consumer) and the router, driven by the openai client,
with each connector (``kv_shared_storage``, ``kv_zmq``). Through the router, completions and chat (streamed or not) are a single server's
greedy output, and the decode server loads the prompts' KV instead of computing it (a kv_zmq
decode server knows no producer: the prefill answer's kv_transfer_params name it); a dead
prefill server costs a recompute on decode, and a client that leaves mid-stream leaves no
request and no block taken on either side. A server answers kv_transfer_params streamed or
not, refuses ill-typed ones with a 400, and recomputes at once where they name a producer
that refuses."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
from conftest import MODEL, Server, _free_port, tokenmill_command
from prometheus_client.parser import text_string_to_metric_families

BLOCK = 16
PROMPT_LENGTHS = (20, 45, 90, 150)
MAX_TOKENS = 8
GREEDY = {"model": MODEL, "temperature": 0, "max_tokens": MAX_TOKENS, "extra_body": {"ignore_eos": True}}
_START_TIMEOUT_S = 120


class Router:
    """A ``tokenmill router`` process."""

    def __init__(self, prefill: list[str], decode: list[str], log_path: Path, *extra: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [*tokenmill_command(), "router", *[a for url in prefill for a in ("--prefill", url)],
                   *[a for url in decode for a in ("--decode", url)], "--port", str(self.port), *extra]
        self._log = open(log_path, "wb")
        self.log_path = log_path
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=os.environ.copy())
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tokenmill router exited:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"tokenmill router did not become healthy:\n{log_path.read_text()[-3000:]}")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


def _transfer(role: str, folder: Path) -> str:
    return json.dumps({"kv_connector": "kv_shared_storage", "kv_role": role,
                       "kv_connector_extra_config": {"shared_storage_path": str(folder)}})


def _zmq_endpoint() -> str:
    return f"tcp://127.0.0.1:{_free_port()}"


def _zmq(role: str, **extra) -> str:
    return json.dumps({"kv_connector": "kv_zmq", "kv_role": role, "kv_connector_extra_config": extra})


def _pair_args(connector: str, tmp_path_factory) -> tuple[str, str]:
    """--kv-transfer-config values of a producer and its consumer."""
    if connector == "kv_shared_storage":
        folder = tmp_path_factory.mktemp("kv-store")
        return _transfer("kv_producer", folder), _transfer("kv_consumer", folder)
    # the consumer knows no producer: it fetches from the one the router's kv_transfer_params name
    return _zmq("kv_producer", bind=_zmq_endpoint()), _zmq("kv_consumer")


@pytest.fixture(scope="module", params=["kv_shared_storage", "kv_zmq"])
def disaggregated(request, start_server, tiny_args, tmp_path_factory):
    """(a plain server, the prefill server, the decode server, the router over those two)."""
    producer_config, consumer_config = _pair_args(request.param, tmp_path_factory)
    plain = start_server(tiny_args())
    prefill = start_server(tiny_args("--kv-transfer-config", producer_config))
    decode = start_server(tiny_args("--kv-transfer-config", consumer_config))
    router = Router([prefill.url], [decode.url], tmp_path_factory.mktemp("router") / "router.log")
    yield plain, prefill, decode, router
    router.stop()


def _wait_all_free(server: Server, timeout_s: float = 15) -> dict:
    """Stats once every KV block is free (a producer frees kept blocks once sent, or at their lease's end)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = server.wait_idle()
        if stats["kv_blocks_free"] == stats["kv_blocks_total"] or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def _counters(server: Server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name in ("tokenmill:prefix_cache_external_hits_total", "tokenmill:iteration_tokens_total_sum")}


def _token_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(n)] for n in PROMPT_LENGTHS]


def _chat_messages(seed: int) -> list[list[dict]]:
    rng = random.Random(seed)
    words = ["river", "stone", "cloud", "north", "paper", "light", "green", "seven"]
    return [[{"role": "user", "content": " ".join(rng.choice(words) for _ in range(n // 6))}] for n in PROMPT_LENGTHS]


def _complete(client: openai.OpenAI, prompt: list[int], stream: bool) -> tuple[str, int | None]:
    if stream:
        chunks = list(client.completions.create(prompt=prompt, stream=True, stream_options={"include_usage": True},
                                                **GREEDY))
        usage = next(c.usage for c in chunks if c.usage is not None)
        return "".join(c.choices[0].text for c in chunks if c.choices), usage.prompt_tokens
    out = client.completions.create(prompt=prompt, **GREEDY)
    return out.choices[0].text, out.usage.prompt_tokens


def _chat(client: openai.OpenAI, messages: list[dict], stream: bool) -> tuple[str, int | None]:
    if stream:
        chunks = list(client.chat.completions.create(messages=messages, stream=True,
                                                     stream_options={"include_usage": True}, **GREEDY))
        usage = next(c.usage for c in chunks if c.usage is not None)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), usage.prompt_tokens
    out = client.chat.completions.create(messages=messages, **GREEDY)
    return out.choices[0].message.content or "", out.usage.prompt_tokens


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_through_the_router_output_is_a_single_servers_and_decode_loads_the_prompts(disaggregated, kind, stream):
    plain, _prefill, decode, router = disaggregated
    seed = {"completions": 0, "chat": 100}[kind] + stream  # fresh prompts: no local prefix-cache hit on decode
    prompts = _token_prompts(seed) if kind == "completions" else _chat_messages(seed)
    call = _complete if kind == "completions" else _chat
    plain_client = openai.OpenAI(base_url=f"{plain.url}/v1", api_key="unused", max_retries=0, timeout=60)
    before = _counters(decode)
    routed = [call(router.client(), p, stream) for p in prompts]
    after = _counters(decode)
    assert [text for text, _ in routed] == [call(plain_client, p, stream)[0] for p in prompts]
    prompt_lengths = [n for _, n in routed]
    assert all(n is not None for n in prompt_lengths)
    loadable = sum((n - 1) // BLOCK * BLOCK for n in prompt_lengths if n)
    hits = after["tokenmill:prefix_cache_external_hits_total"] - before["tokenmill:prefix_cache_external_hits_total"]
    computed = after["tokenmill:iteration_tokens_total_sum"] - before["tokenmill:iteration_tokens_total_sum"]
    assert hits == loadable  # every whole prompt block came from the prefill server
    # computed on decode: each prompt's tail (under a block) and its decode steps, never a whole prompt
    assert computed == sum(prompt_lengths) - loadable + len(prompts) * (MAX_TOKENS - 1)
    for server in (_prefill, decode):
        stats = _wait_all_free(server)
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"], stats


def test_a_dead_prefill_server_costs_a_recompute_on_decode(disaggregated, start_server, tiny_args, tmp_path_factory):
    plain, _prefill, decode, _router = disaggregated
    doomed = Server(tiny_args("--kv-transfer-config", _transfer("kv_producer", tmp_path_factory.mktemp("lost"))),
                    tmp_path_factory.mktemp("doomed") / "server.log")
    router = Router([doomed.url], [decode.url], tmp_path_factory.mktemp("router") / "router.log")
    try:
        doomed.process.send_signal(signal.SIGKILL)
        doomed.process.wait()
        prompt = _token_prompts(7)[2]
        before = _counters(decode)
        started = time.monotonic()
        text, _ = _complete(router.client(), prompt, stream=False)
        assert time.monotonic() - started < 30  # no long fixed timeout: a refused connection is seen at once
        plain_client = openai.OpenAI(base_url=f"{plain.url}/v1", api_key="unused", max_retries=0, timeout=60)
        assert text == _complete(plain_client, prompt, stream=False)[0]
        after = _counters(decode)
        assert after["tokenmill:prefix_cache_external_hits_total"] == before["tokenmill:prefix_cache_external_hits_total"]
        assert httpx.get(f"{router.url}/health", timeout=10).json()["prefill_failures"] == 1
    finally:
        router.stop()
        doomed.stop()


def test_a_client_leaving_mid_stream_leaves_nothing_taken_on_either_side(disaggregated):
    _plain, prefill, decode, router = disaggregated
    # 8 samples of 230 tokens: far longer than reading one event and leaving
    long_body = {"model": MODEL, "prompt": _token_prompts(11)[0], "max_tokens": 230, "n": 8, "temperature": 0,
                 "ignore_eos": True, "stream": True}
    before = decode.stats()["client_disconnects"]
    with httpx.Client(base_url=router.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=long_body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(lines).startswith("data: {")
    for server in (prefill, decode):
        stats = _wait_all_free(server)
        assert stats["running"] == stats["waiting"] == stats["unfinished"] == 0, stats
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"], stats
    assert decode.stats()["client_disconnects"] == before + 1  # aborted there, not run to its end


@pytest.fixture(scope="module")
def zmq_pair(tiny_args, tmp_path_factory):
    """A kv_zmq producer with a 1 s lease and its consumer (fetches time out after 2 s), unrouted."""
    endpoint = _zmq_endpoint()
    producer = Server(tiny_args("--kv-transfer-config", _zmq("kv_producer", bind=endpoint, lease_s=1)),
                      tmp_path_factory.mktemp("producer") / "server.log")
    producer.zmq_endpoint = endpoint
    consumer = Server(tiny_args("--kv-transfer-config", _zmq("kv_consumer", peers=[endpoint], fetch_timeout_s=2)),
                      tmp_path_factory.mktemp("consumer") / "server.log")
    yield producer, consumer
    consumer.stop()
    producer.stop()


def _prefill_directly(server: Server, prompt: list[int]) -> None:
    response = httpx.post(f"{server.url}/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert response.status_code == 200, response.text


def _ask_prefill(server: Server, kind: str, stream: bool, seed: int) -> dict | None:
    """What the router asks a prefill server (do_remote_decode, one token): the answer's kv_transfer_params."""
    body: dict = {"model": MODEL, "max_tokens": 1, "temperature": 0, "stream": stream,
                  "kv_transfer_params": {"do_remote_decode": True}}
    if kind == "completions":
        body["prompt"] = _token_prompts(seed)[3]
    else:
        body["messages"] = _chat_messages(seed)[3]
    response = httpx.post(f"{server.url}/v1/{'completions' if kind == 'completions' else 'chat/completions'}",
                          json=body, timeout=60)
    assert response.status_code == 200, response.text
    if not stream:
        return response.json()["kv_transfer_params"]
    chunks = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: {")]
    carrying = [c for c in chunks if c.get("kv_transfer_params") is not None]
    assert len(carrying) == 1 and carrying[0]["choices"][0]["finish_reason"] is not None  # once, on the last
    return carrying[0]["kv_transfer_params"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_a_zmq_prefill_server_answers_where_its_kv_is_streamed_or_not(zmq_pair, kind, stream):
    producer, _consumer = zmq_pair
    params = _ask_prefill(producer, kind, stream, seed=30 + stream + 2 * (kind == "chat"))
    assert params is not None and params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert f"tcp://{params['remote_host']}:{params['remote_port']}" == producer.zmq_endpoint
    assert params["remote_block_ids"] and params["remote_request_id"]


def test_ill_typed_kv_transfer_params_are_a_400_and_a_refusing_producer_a_recompute(zmq_pair, start_server,
                                                                                    tiny_args):
    _producer, consumer = zmq_pair
    prompt = _token_prompts(31)[3]
    for bad in ({"do_remote_prefill": "yes"}, {"remote_port": "5600"}, ["do_remote_prefill"]):
        response = httpx.post(f"{consumer.url}/v1/completions", timeout=30,
                              json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "kv_transfer_params": bad})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"].startswith("kv_transfer_params"), response.text
    host, port = _zmq_endpoint().removeprefix("tcp://").rsplit(":", 1)  # nobody listens there
    before = _counters(consumer)
    consumer_client = openai.OpenAI(base_url=f"{consumer.url}/v1", api_key="unused", max_retries=0, timeout=60)
    refused = {"do_remote_prefill": True, "remote_host": host, "remote_port": int(port)}
    text = consumer_client.completions.create(prompt=prompt, **{**GREEDY, "extra_body": {
        "ignore_eos": True, "kv_transfer_params": refused}}).choices[0].text
    plain_client = openai.OpenAI(base_url=f"{start_server(tiny_args()).url}/v1", api_key="unused", max_retries=0,
                                 timeout=60)
    assert text == _complete(plain_client, prompt, stream=False)[0]
    after = _counters(consumer)
    assert after["tokenmill:prefix_cache_external_hits_total"] == before["tokenmill:prefix_cache_external_hits_total"]


def test_a_zmq_producer_frees_what_no_consumer_fetches_after_its_lease(zmq_pair):
    producer, _consumer = zmq_pair
    _prefill_directly(producer, _token_prompts(21)[3])
    stats = producer.wait_idle()
    assert stats["kv_blocks_free"] < stats["kv_blocks_total"]  # kept for a consumer...
    stats = _wait_all_free(producer)
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], stats  # ...until the lease ended


def test_a_zmq_producer_killed_before_the_fetch_costs_the_consumer_a_recompute(zmq_pair, start_server, tiny_args):
    plain = start_server(tiny_args())
    producer, consumer = zmq_pair
    prompt = _token_prompts(22)[3]
    _prefill_directly(producer, prompt)
    producer.process.send_signal(signal.SIGKILL)
    producer.process.wait()
    before = _counters(consumer)
    consumer_client = openai.OpenAI(base_url=f"{consumer.url}/v1", api_key="unused", max_retries=0, timeout=60)
    plain_client = openai.OpenAI(base_url=f"{plain.url}/v1", api_key="unused", max_retries=0, timeout=60)
    started = time.monotonic()
    text, _ = _complete(consumer_client, prompt, stream=False)
    assert time.monotonic() - started < 30  # the fetch deadline (2 s), not a long fixed wait
    assert text == _complete(plain_client, prompt, stream=False)[0]
    after = _counters(consumer)
    assert after["tokenmill:prefix_cache_external_hits_total"] == before["tokenmill:prefix_cache_external_hits_total"]
    stats = _wait_all_free(consumer)
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], stats

