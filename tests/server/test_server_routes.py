"""/v1/models, /v1/embeddings, /tokenize, /detokenize, /version, /engine/stats, /openapi.json."""

from __future__ import annotations

import base64
import math
import struct

import openai
import pytest
from conftest import MODEL

import tokenmill

HIDDEN_SIZE = 64  # tests/tiny_models.py


def test_models(client, server):
    (card,) = client.models.list().data
    assert card.id == MODEL and card.object == "model" and card.owned_by == "tokenmill"
    assert card.model_extra["max_model_len"] == 256
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


@pytest.mark.parametrize("encoding_format", [None, "float", "base64"])
def test_embeddings_shapes(client, encoding_format):
    """Unasked, the client requests base64 and decodes it; asked for base64, it hands the string back."""
    kwargs = {"encoding_format": encoding_format} if encoding_format else {}
    out = client.embeddings.create(model=MODEL, input=["The quick brown fox", "Paged attention"], **kwargs)
    assert [d.index for d in out.data] == [0, 1] and out.model == MODEL
    vectors = [_decoded(d.embedding) for d in out.data]
    assert all(len(v) == HIDDEN_SIZE and all(math.isfinite(x) for x in v) for v in vectors)
    assert vectors[0] != vectors[1]
    assert out.usage.prompt_tokens == out.usage.total_tokens > 0


def _decoded(embedding: list[float] | str) -> list[float]:
    if isinstance(embedding, str):
        raw = base64.b64decode(embedding)
        return list(struct.unpack(f"<{len(raw) // 4}f", raw))
    return embedding


def test_base64_and_float_agree(client):
    floats = client.embeddings.create(model=MODEL, input="Paged attention", encoding_format="float").data[0]
    packed = client.embeddings.create(model=MODEL, input="Paged attention", encoding_format="base64").data[0]
    assert _decoded(packed.embedding) == pytest.approx(floats.embedding, rel=1e-6)


def test_embedding_forms_and_pooling(client, http):
    ids = http.post("/tokenize", json={"prompt": "The quick brown fox"}).json()["tokens"]
    by_text = client.embeddings.create(model=MODEL, input="The quick brown fox").data[0].embedding
    by_ids = client.embeddings.create(model=MODEL, input=ids).data[0].embedding
    batch = client.embeddings.create(model=MODEL, input=[ids, ids[:2]]).data
    mean = client.embeddings.create(model=MODEL, input=ids, extra_body={"pooling": "mean"}).data[0].embedding
    assert by_ids == pytest.approx(by_text, abs=1e-5)
    assert batch[0].embedding == pytest.approx(by_text, abs=1e-5) and len(batch) == 2
    assert len(mean) == HIDDEN_SIZE and mean != pytest.approx(by_text, abs=1e-3)


def test_embedding_errors(http):
    assert http.post("/v1/embeddings", json={"input": "hi", "dimensions": 8}).json()["error"]["param"] == "dimensions"
    assert http.post("/v1/embeddings", json={"input": []}).json()["error"]["param"] == "input"
    assert http.post("/v1/embeddings", json={"input": "hi", "pooling": "max"}).json()["error"]["param"] == "pooling"
    too_long = http.post("/v1/embeddings", json={"input": list(range(5, 300))})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "input"


def test_tokenize_detokenize_round_trip(http):
    text = "The capital of France is Paris."
    out = http.post("/tokenize", json={"model": MODEL, "prompt": text}).json()
    assert out["count"] == len(out["tokens"]) > 0 and out["max_model_len"] == 256
    assert http.post("/detokenize", json={"model": MODEL, "tokens": out["tokens"]}).json() == {"prompt": text}


def test_tokenize_unknown_model_is_404(http):
    assert http.post("/tokenize", json={"model": "other", "prompt": "x"}).status_code == 404


def test_version_and_stats(http):
    assert http.get("/version").json() == {"version": tokenmill.__version__}
    stats = http.get("/engine/stats").json()
    assert {"running", "waiting", "unfinished", "kv_blocks_free", "kv_blocks_total", "client_disconnects"} <= set(stats)
    assert 0 < stats["kv_blocks_free"] <= stats["kv_blocks_total"]


def test_openapi_schema_lists_every_route(http):
    schema = http.get("/openapi.json").json()
    assert {"/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize", "/detokenize",
            "/health", "/version", "/engine/stats"} <= set(schema["paths"])
    request = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"prompt", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "logprobs", "echo", "logit_bias",
            "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stream_options"} <= set(request)
