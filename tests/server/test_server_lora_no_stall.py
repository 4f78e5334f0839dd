"""No stall while an adapter loads at run time, and adapters from the Hub.

``POST /v1/load_lora_adapter`` names a Hub id; the server fetches it with huggingface_hub from
a stand-in Hub on 127.0.0.1 (``HF_ENDPOINT``) that sends the weights file slowly, so the load
really takes seconds. Meanwhile streaming requests on other adapters (and the base) go on:
every gap between two tokens a stream receives during the load is much shorter than the load
itself. The adapter fetched from the Hub then answers as the same adapter read from its folder.
"""

from __future__ import annotations

import itertools
import threading
import time

import httpx
import openai
import pytest
from conftest import API_KEY, MODEL
from fake_hub import FakeHub
from lora_models import build_adapter

PROMPT = [11, 12, 13, 14, 15, 16, 17]
THROTTLE_SECONDS = 3.0  # how long the stand-in Hub takes to send the weights file
REPO = "tiny-org/slow-lora"


@pytest.fixture(scope="module")
def adapters(llama_path, tmp_path_factory):
    specs = {"steady-attn": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
             "steady-mlp": {"r": 8, "lora_alpha": 8, "target_modules": ["gate_proj", "down_proj"]},
             "slow": {"r": 4, "lora_alpha": 16, "target_modules": ["o_proj", "up_proj"]}}
    return {name: build_adapter(llama_path, tmp_path_factory.mktemp(name), seed=i, **args)
            for i, (name, args) in enumerate(specs.items())}


@pytest.fixture(scope="module")
def hub(adapters):
    with FakeHub(REPO, adapters["slow"], slow_files=frozenset({"adapter_model.safetensors"}),
                 throttle_seconds=THROTTLE_SECONDS) as fake:
        yield fake


@pytest.fixture(scope="module")
def hub_server(start_server, tiny_args, adapters, hub, tmp_path_factory):
    folders = {**{name: adapters[name] for name in ("steady-attn", "steady-mlp")},
               "slow-local": adapters["slow"]}  # the same adapter as the Hub's, from its folder
    modules = [arg for name, folder in folders.items() for arg in ("--lora-modules", f"{name}={folder}")]
    return start_server(
        tiny_args("--enable-lora", "--max-lora-rank", "8", "--max-loras", "4", *modules),
        env={"TOKENMILL_API_KEY": API_KEY, "TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING": "1", "HF_ENDPOINT": hub.url,
             "HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path_factory.mktemp("hf-home"))})


@pytest.fixture(scope="module")
def client(hub_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{hub_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _stream_until(client: openai.OpenAI, model: str, stop: threading.Event, arrivals: list[float]) -> None:
    """Stream completions on ``model`` one after another until ``stop``, noting when each token
    arrives (one list across the requests: a new request's first token counts as well)."""
    while not stop.is_set():
        stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=48, temperature=0.0,
                                           stream=True, extra_body={"ignore_eos": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                arrivals.append(time.perf_counter())


def _complete(client: openai.OpenAI, model: str) -> str:
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0.0,
                                      extra_body={"ignore_eos": True})
    return reply.choices[0].text


def test_streams_on_other_adapters_do_not_wait_for_a_load(client, hub_server, hub):
    models = ["steady-attn", "steady-mlp", MODEL]
    arrivals: dict[str, list[float]] = {model: [] for model in models}
    stop = threading.Event()
    threads = [threading.Thread(target=_stream_until, args=(client, m, stop, arrivals[m])) for m in models]
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + 120
        while not all(len(times) >= 5 for times in arrivals.values()):  # every stream is under way
            assert time.monotonic() < deadline, "the streams did not start"
            time.sleep(0.05)
        with httpx.Client(base_url=hub_server.url, headers={"Authorization": f"Bearer {API_KEY}"},
                          timeout=120) as http:
            start = time.perf_counter()
            loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "slow", "lora_path": REPO})
            end = time.perf_counter()
        time.sleep(0.3)  # a little of the time after the load, so the last gap in the window closes
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=120)
    assert loaded.status_code == 200, loaded.text
    assert "adapter_model.safetensors" in hub.downloads  # it really came through huggingface_hub
    load_seconds = end - start
    assert load_seconds >= THROTTLE_SECONDS  # the load was as long as the slow Hub made it
    for model, times in arrivals.items():
        during = [t for t in times if start < t < end]
        assert len(during) >= 10, f"{model}: only {len(during)} tokens arrived during the {load_seconds:.1f}s load"
        gaps = [later - earlier for earlier, later in itertools.pairwise(times)
                if later > start and earlier < end]  # every gap that overlaps the load
        assert max(gaps) < load_seconds / 4, (
            f"{model}: a {max(gaps):.2f}s gap between tokens during a {load_seconds:.2f}s load")


def test_an_adapter_from_the_hub_answers_as_from_its_folder(client, hub_server, hub):
    with httpx.Client(base_url=hub_server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as http:
        answer = http.post("/v1/load_lora_adapter", json={"lora_name": "slow", "lora_path": REPO})
    assert answer.status_code == 200, answer.text  # loaded by the test above, or now
    assert "slow" in {card.id for card in client.models.list().data}
    assert _complete(client, "slow") == _complete(client, "slow-local") != _complete(client, MODEL)


def test_an_unknown_hub_repo_is_a_400_naming_the_adapter(hub_server):
    with httpx.Client(base_url=hub_server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as http:
        answer = http.post("/v1/load_lora_adapter", json={"lora_name": "ghost", "lora_path": "tiny-org/none"})
    assert answer.status_code == 400, answer.text
    message = answer.json()["error"]["message"]
    assert "LoRA adapter 'ghost'" in message and "tiny-org/none" in message, message
