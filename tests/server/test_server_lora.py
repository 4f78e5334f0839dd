"""LoRA adapters through ``tokenmill serve``, with the official openai client over real HTTP:
adapters as model ids, per-adapter answers equal to the offline engine's, run-time load and
unload (behind their flag and the API key), and bad adapters answered with a 400."""

from __future__ import annotations

import json
import shutil

import httpx
import openai
import pytest
from conftest import API_KEY, MODEL
from lora_models import build_adapter

from tokenmill import LLM, LoRARequest, SamplingParams

PROMPT = [11, 12, 13, 14, 15, 16, 17]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapter_paths(llama_path, tmp_path_factory) -> dict[str, str]:
    specs = {"attn": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
             "mlp": {"r": 8, "lora_alpha": 8, "use_rslora": True, "target_modules": ["gate_proj", "down_proj"]},
             "late": {"r": 4, "lora_alpha": 16, "target_modules": ["o_proj", "up_proj"]}}
    return {name: str(build_adapter(llama_path, tmp_path_factory.mktemp(name), seed=i, **args))
            for i, (name, args) in enumerate(specs.items())}


@pytest.fixture(scope="module")
def lora_server(start_server, tiny_args, adapter_paths):
    json_form = json.dumps({"name": "mlp", "path": adapter_paths["mlp"], "base_model_name": MODEL})
    return start_server(tiny_args("--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
                                  "--lora-modules", f"attn={adapter_paths['attn']}", json_form),  # vLLM's one-flag form
                        env={"TOKENMILL_API_KEY": API_KEY, "TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING": "1"})


@pytest.fixture(scope="module")
def lora_client(lora_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def lora_http(lora_server):
    with httpx.Client(base_url=lora_server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def offline(llama_path, adapter_paths) -> dict[str | None, str]:
    """Each adapter's (and the base's) completion text from the offline engine."""
    llm = LLM(str(llama_path), dtype="float32", max_model_len=256, kv_cache_memory="16MiB", enable_lora=True,
              max_lora_rank=8)
    names: list[str | None] = [None, *adapter_paths]
    loras = [LoRARequest(n, i + 1, adapter_paths[n]) if n else None for i, n in enumerate(names)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": PROMPT}] * len(names), params, lora_request=loras)
    llm.engine.shutdown()
    return {name: out.outputs[0].text for name, out in zip(names, outputs, strict=True)}


def _complete(client: openai.OpenAI, model: str) -> str:
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                      extra_body={"ignore_eos": True})
    return reply.choices[0].text


def test_adapters_are_models_with_the_base_as_parent(lora_client):
    cards = {card.id: card for card in lora_client.models.list().data}
    assert set(cards) == {MODEL, "attn", "mlp"}
    assert cards["attn"].model_extra["parent"] == cards["mlp"].model_extra["parent"] == MODEL
    assert cards[MODEL].model_extra.get("parent") is None
    assert lora_client.models.retrieve("attn").id == "attn"


def test_each_adapter_answers_as_offline(lora_client, offline):
    assert len({offline[None], offline["attn"], offline["mlp"]}) == 3  # the adapters change the answer
    for model, name in ((MODEL, None), ("attn", "attn"), ("mlp", "mlp")):
        assert _complete(lora_client, model) == offline[name], model
    chat = lora_client.chat.completions.create(model="attn", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4, temperature=0.0)
    assert chat.model == "attn" and chat.choices[0].message.content is not None


def test_responses_and_messages_routes_serve_adapters(lora_client, lora_http):
    """An adapter named in ``model`` answers the Responses and Messages routes as it does chat."""
    def chat(model: str) -> str | None:
        reply = lora_client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=6, temperature=0.0)
        return reply.choices[0].message.content

    for model in ("attn", "mlp"):
        response = lora_client.responses.create(model=model, input="hi", max_output_tokens=6, temperature=0.0)
        assert response.model == model and response.output_text == chat(model)
        message = lora_http.post("/v1/messages", json={"model": model, "max_tokens": 6, "temperature": 0.0,
                                                       "messages": [{"role": "user", "content": "hi"}]})
        assert message.status_code == 200, message.text
        assert message.json()["model"] == model
        assert "".join(block["text"] for block in message.json()["content"]) == chat(model)
    assert chat("attn") != chat(MODEL)  # the adapter is really applied


def test_load_request_unload_request(lora_client, lora_http, adapter_paths, offline):
    loaded = lora_http.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": adapter_paths["late"]})
    assert loaded.status_code == 200, loaded.text
    assert "late" in {card.id for card in lora_client.models.list().data}
    assert _complete(lora_client, "late") == offline["late"]
    assert lora_http.post("/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
    with pytest.raises(openai.NotFoundError, match="late"):
        _complete(lora_client, "late")
    again = lora_http.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert again.status_code == 404 and "late" in again.json()["error"]["message"]


def test_unload_lets_running_requests_finish(lora_client, lora_http, adapter_paths):
    assert lora_http.post("/v1/load_lora_adapter",
                          json={"lora_name": "busy", "lora_path": adapter_paths["late"]}).status_code == 200
    stream = lora_client.completions.create(model="busy", prompt=PROMPT, max_tokens=40, temperature=0.0,
                                            stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    first = next(chunks)
    assert lora_http.post("/v1/unload_lora_adapter", json={"lora_name": "busy"}).status_code == 200
    rest = list(chunks)
    finish = [c.choices[0].finish_reason for c in [first, *rest] if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    with pytest.raises(openai.NotFoundError, match="busy"):
        _complete(lora_client, "busy")


def test_bad_adapters_are_400s_naming_them(lora_client, lora_http, llama_path, adapter_paths, offline, tmp_path):
    corrupt = shutil.copytree(adapter_paths["late"], tmp_path / "corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    wide = build_adapter(llama_path, tmp_path / "wide", r=16, target_modules=["q_proj"])
    cases = {"nowhere": (str(tmp_path / "missing"), "no adapter folder"),
             "wide": (str(wide), "above max_lora_rank=8"),
             "garbled": (str(corrupt), "safetensors")}
    for name, (path, problem) in cases.items():
        answer = lora_http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
        assert answer.status_code == 400, answer.text
        message = answer.json()["error"]["message"]
        assert f"LoRA adapter {name!r}" in message and problem in message, message
    assert _complete(lora_client, "attn") == offline["attn"]  # still serving, unchanged


def test_runtime_routes_need_the_key(lora_server):
    answer = httpx.post(f"{lora_server.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"})
    assert answer.status_code == 401


def test_runtime_routes_need_their_flag(http):
    """The default server (no --allow-runtime-lora) has no such routes."""
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"}).status_code == 404


def test_runtime_routes_are_in_the_strict_schema(lora_http):
    """Both routes documented: a JSON body, a 200 model, OpenAI-shaped errors, no FastAPI 422."""
    schema = lora_http.get("/openapi.json").json()
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        operation = schema["paths"][path]["post"]
        assert "application/json" in operation["requestBody"]["content"]
        assert {"200", "400", "404"} <= set(operation["responses"]) and "422" not in operation["responses"]
    load = schema["components"]["schemas"]["LoadLoRAAdapterRequest"]
    assert set(load["required"]) == {"lora_name", "lora_path"} and load["additionalProperties"] is False
    assert "parent" in schema["components"]["schemas"]["ModelCard"]["properties"]
