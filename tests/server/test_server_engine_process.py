"""``tokenmill serve --engine-process``: the engine steps in a child process of the server's.

One server on the fault-injection model (the tiny Llama, with a poison token that makes the
forward raise), driven by the official openai client. Its engine is killed by the last test.
A second one serves a tiny MoE model, for the expert-load series its engine process sends.
"""

from __future__ import annotations

import asyncio
import random

import httpx
import openai
import psutil
import pytest
from conftest import MODEL, Server
from fault_model import RAISE_TOKEN
from moe_models import build_moe_model
from prometheus_client import CollectorRegistry
from test_server_metrics import delta, scrape

from tokenmill import LLM, AsyncLLM, SamplingParams

PROMPTS = ["The quick brown fox", "Hello", "1 2 3 4"]
HANG_GUARD_S = 60  # a request to a dead engine must answer; this only ends a test that would hang
MOE_ARGS = {"max_model_len": 64, "kv_cache_memory": "8MiB", "dtype": "float32"}
EXPERT_SERIES = ("tokenmill:moe_expert_tokens_total", "tokenmill:moe_expert_load_imbalance")


@pytest.fixture(scope="module")
def ep(start_server, fault_model_path) -> Server:
    return start_server([str(fault_model_path), "--served-model-name", MODEL, "--max-model-len", "256",
                         "--kv-cache-memory", "16MiB", "--dtype", "float32", "--engine-process"])


@pytest.fixture(scope="module")
def client(ep: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{ep.url}/v1", api_key="none", max_retries=0, timeout=HANG_GUARD_S)


def _engine_processes(server: Server) -> list[psutil.Process]:
    """The server's spawned children but multiprocessing's resource tracker: its engine core."""
    found = []
    for child in psutil.Process(server.process.pid).children():
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.NoSuchProcess:  # it ended meanwhile
            pass
    return found


def test_the_engine_steps_in_a_child_process(ep):
    assert len(_engine_processes(ep)) == 1


def test_greedy_completions_are_the_in_thread_engines(client, fault_model_path):
    """Non-streamed and streamed: the text the same model gives stepped in the caller's thread."""
    offline = LLM(str(fault_model_path), max_model_len=256, kv_cache_memory="16MiB", dtype="float32")
    expected = [o.outputs[0].text for o in offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))]
    plain = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in sorted(plain.choices, key=lambda c: c.index)] == expected
    streamed = ["", "", ""]
    for chunk in client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == expected


def test_a_client_that_leaves_mid_stream_aborts_its_request(ep):
    before = ep.stats()["client_disconnects"]
    with httpx.Client(base_url=ep.url, timeout=HANG_GUARD_S) as http:
        with http.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 200,
                                                          "ignore_eos": True, "stream": True}) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: {")
    stats = ep.wait_idle()
    assert stats["running"] == stats["waiting"] == stats["unfinished"] == 0, stats
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], stats
    assert stats["client_disconnects"] == before + 1


def test_metrics_count_what_the_engine_process_did(ep, client):
    _, before = scrape(ep)
    usage = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, extra_body={"ignore_eos": True}).usage
    _, after = scrape(ep)
    assert usage.completion_tokens == 4
    assert delta(after, before, "tokenmill:generation_tokens_total") == 4
    assert delta(after, before, "tokenmill:prompt_tokens_total") == 3
    assert delta(after, before, "tokenmill:request_success_total", finished_reason="length") == 1


def test_a_bad_constraint_is_a_400_from_the_api_process(ep, client):
    """Validated at admission, before the request crosses to the engine; a good one still runs there."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="a", max_tokens=3,
                                  extra_body={"structured_outputs": {"regex": "[a-z"}})
    assert caught.value.body["param"] == "structured_outputs.regex", caught.value.body
    choice = client.completions.create(model=MODEL, prompt="a", max_tokens=5, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}}).choices[0]
    assert choice.text in ("yes", "no")


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return build_moe_model(tmp_path_factory.mktemp("qwen2-moe"), "qwen2-moe")


def _moe_prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 380) for _ in range(n)] for n in (4, 11, 19, 30)]


def _expert_series(samples: dict) -> dict:
    return {key: value for key, value in samples.items() if key[0] in EXPERT_SERIES}


def test_expert_load_series_are_the_in_thread_modes(start_server, moe_path):
    """The engine process reads its MoE counters and sends them with its stats: after the same
    greedy requests, one at a time, /metrics has the series an in-thread engine exports."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    registry = CollectorRegistry()
    in_thread = AsyncLLM(str(moe_path), **MOE_ARGS)
    in_thread.add_expert_load_logger(MODEL, registry)  # what the server attaches, on the in-thread engine

    async def run() -> None:
        for prompt in _moe_prompts():
            async for _ in in_thread.generate({"prompt_token_ids": prompt}, params):
                pass

    try:
        asyncio.run(run())
    finally:
        in_thread.shutdown()
    expected = _expert_series({(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))):
                               s.value for metric in registry.collect() for s in metric.samples})
    computed = sum(len(p) for p in _moe_prompts()) + len(_moe_prompts()) * 5  # the last token is not fed back
    for layer in ("model.layers.0.mlp.experts", "model.layers.2.mlp.experts"):  # top-2 of 8; layer 1 is dense
        assert sum(value for (name, labels), value in expected.items()
                   if name == EXPERT_SERIES[0] and dict(labels)["layer"] == layer) == 2 * computed, layer
    server = start_server([str(moe_path), "--served-model-name", MODEL, "--max-model-len", "64",
                           "--kv-cache-memory", "8MiB", "--dtype", "float32", "--engine-process"])
    with httpx.Client(base_url=server.url, timeout=HANG_GUARD_S) as http:
        for prompt in _moe_prompts():
            answer = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 6,
                                                        "temperature": 0, "ignore_eos": True})
            assert answer.status_code == 200, answer.text
    assert _expert_series(scrape(server)[1]) == expected


def test_an_engine_that_dies_fails_requests_with_an_error_not_a_hang(ep, client):
    """Last: the poison token makes the forward raise in the engine process."""
    with pytest.raises(openai.InternalServerError) as error:
        client.completions.create(model=MODEL, prompt=[5, RAISE_TOKEN], max_tokens=2)
    assert error.value.status_code == 500 and "InjectedFault" in error.value.message
    with pytest.raises(openai.InternalServerError, match="engine loop died"):
        client.completions.create(model=MODEL, prompt="hello", max_tokens=2)
    health = httpx.get(f"{ep.url}/health", timeout=HANG_GUARD_S)
    assert health.status_code == 503 and "InjectedFault" in health.text
    _, alive = psutil.wait_procs(_engine_processes(ep), timeout=HANG_GUARD_S)
    assert alive == [] and _engine_processes(ep) == []  # the engine process ended (and was reaped) after reporting
