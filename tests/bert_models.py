"""Tiny random BERT checkpoints (an embedding model, cross-encoders) with a WordPiece tokenizer,
saved by transformers, and the transformers answers the engine must match."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

WORDS = ("the a is on of and to in what where who how cat dog man woman food bread city river paris france "
         "capital eats sleeps runs mat park big small red blue music plays guitar today weather sunny").split()


def build_tokenizer(folder: Path) -> Any:
    from transformers import BertTokenizerFast

    vocab = list(dict.fromkeys(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS,
                                *"abcdefghijklmnopqrstuvwxyz.,?!", *(f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz")]))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = BertTokenizerFast(vocab=str(folder / "vocab.txt"), do_lower_case=True)  # transformers 5: vocab=
    assert len(tokenizer) == len(vocab), "the WordPiece vocabulary was not read"
    tokenizer.save_pretrained(folder)
    return tokenizer


def build_bert(folder: Path, architecture: str, *, num_labels: int = 1, pooling: str | None = None,
               normalize: bool = False, seed: int = 0, max_position_embeddings: int = 64) -> Path:
    """``architecture``: BertModel or BertForSequenceClassification. ``pooling`` ("mean", "cls",
    "lasttoken") writes sentence-transformers files; ``normalize`` adds their Normalize module."""
    import transformers

    tokenizer = build_tokenizer(folder)
    config = transformers.BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64,
                                     max_position_embeddings=max_position_embeddings,
                                     num_labels=num_labels, pad_token_id=0)
    _save_random(lambda: getattr(transformers, architecture)(config), folder, seed)
    if pooling is not None:
        _write_sentence_transformers_files(folder, pooling, normalize)
    return folder


def build_roberta(folder: Path, architecture: str, *, num_labels: int = 1, pooling: str | None = None,
                  seed: int = 0, max_positions: int = 64) -> Path:
    """``architecture``: (XLM)RobertaModel or (XLM)RobertaForSequenceClassification, with a byte-level
    BPE tokenizer whose ``<pad>`` is id 1 as in RoBERTa's, so positions start at row 2 of a table
    of ``max_positions + 2`` rows, and one token type."""
    import transformers

    tokenizer = build_roberta_tokenizer(folder)
    config_class = transformers.XLMRobertaConfig if architecture.startswith("XLM") else transformers.RobertaConfig
    config = config_class(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=64, max_position_embeddings=max_positions + 2, type_vocab_size=1,
                          num_labels=num_labels, pad_token_id=1, bos_token_id=0, eos_token_id=2)
    _save_random(lambda: getattr(transformers, architecture)(config), folder, seed)
    if pooling is not None:
        _write_sentence_transformers_files(folder, pooling, normalize=False)
    return folder


def build_roberta_tokenizer(folder: Path) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import RobertaTokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([" ".join(WORDS), "what is the capital of france? paris is the capital of france."] * 5,
                            trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split()) for m in model["merges"]]
    tokenizer = RobertaTokenizer(vocab=model["vocab"], merges=merges)
    assert tokenizer.pad_token_id == 1, "RoBERTa's padding id, which its positions are offset by"
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(folder)
    return tokenizer


def _save_random(build: Any, folder: Path, seed: int) -> None:
    torch.manual_seed(seed)
    model = build()
    with torch.no_grad():  # weights large enough that every input (and token type) moves the output,
        for name, param in model.named_parameters():  # and random norms and biases, so a misplaced one shows
            if "LayerNorm" in name and name.endswith("weight"):
                param.normal_(1.0, 0.2)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.2)
            else:
                param.normal_(0.0, 1.0 if "embeddings" in name else 0.3)
    model.save_pretrained(folder)


def _write_sentence_transformers_files(folder: Path, pooling: str, normalize: bool) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, f"pooling_mode_{pooling}_token" if pooling == "cls" else
         "pooling_mode_mean_tokens" if pooling == "mean" else "pooling_mode_lasttoken": True}))


def sentence_transformers_embeddings(folder: Path, texts: list[str], pooling: str, normalize: bool) -> torch.Tensor:
    """What sentence-transformers computes, with transformers directly: one padded batch,
    then CLS / masked-mean / last-token pooling and optional L2 normalisation (float32)."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    if pooling == "cls":
        pooled = hidden[:, 0]
    elif pooling == "mean":
        pooled = (hidden * mask).sum(1) / mask.sum(1)
    else:
        pooled = hidden[torch.arange(len(texts)), batch["attention_mask"].sum(1) - 1]
    return torch.nn.functional.normalize(pooled, dim=-1) if normalize else pooled


def cross_encoder_logits(folder: Path, pairs: list[tuple[str, str]]) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    batch = tokenizer([a for a, _ in pairs], [b for _, b in pairs], padding=True, return_tensors="pt")
    with torch.no_grad():
        return model(**batch).logits


def classifier_logits(folder: Path, texts: list[str]) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(**AutoTokenizer.from_pretrained(folder)(texts, padding=True, return_tensors="pt")).logits
