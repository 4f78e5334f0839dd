"""The pieces ``LLM`` and the server share to score text pairs and classify texts.

A cross-encoder (a model whose pooled output is class logits) reads each pair as one
input, ``[CLS] text_1 [SEP] text_2 [SEP]``, tokenized here as its tokenizer pairs them;
its score is the logit of its single label. An embedding model scores a pair by the
cosine similarity of the two texts' embeddings.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenmill.engine.model_info import ModelInfo
from tokenmill.errors import InvalidRequestError


def score_pairs(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one ``text_1`` against each ``text_2`` (or each ``text_1`` against one
    ``text_2``), or equally long lists zipped."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if not first or not second:
        raise InvalidRequestError("score needs at least one text on each side", param="text_1")
    if len(first) == 1:
        first = first * len(second)
    elif len(second) == 1:
        second = second * len(first)
    if len(first) != len(second):
        raise InvalidRequestError(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or "
                                  "as many as text_2", param="text_2")
    return list(zip(first, second, strict=True))


def pair_prompt(tokenizer: Any, text_1: str, text_2: str, max_length: int | None) -> dict[str, Any]:
    """A cross-encoder's input for one pair, truncated (longest side first) to ``max_length``."""
    if tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer: pairs cannot be scored", param="text_1")
    if not text_1 or not text_2:
        raise InvalidRequestError("a text to score must not be empty", param="text_1" if not text_1 else "text_2")
    encoded = tokenizer(text_1, text_2, truncation=max_length is not None, max_length=max_length)
    return {"prompt_token_ids": list(encoded["input_ids"])}


def pair_max_length(info: ModelInfo, truncate_prompt_tokens: int | None) -> int | None:
    if truncate_prompt_tokens is None:
        return None
    limit = info.max_prompt_tokens or info.max_model_len - 1
    return limit if truncate_prompt_tokens == -1 else min(truncate_prompt_tokens, limit)


def cross_encoder_score(logits: list[float]) -> float:
    if len(logits) != 1:
        raise InvalidRequestError(f"the model classifies into {len(logits)} labels: a score needs a model with "
                                  "one label (a cross-encoder); use classify", param="model")
    return logits[0]


def check_classifier(info: ModelInfo, wanted: bool, what: str) -> None:
    """Classify needs a classification head; embed needs a model without one. (A model that
    does not pool at all is refused by ``check_runner``, naming its runner.)"""
    if info.pooler is None and not wanted:
        return
    if info.classifies != wanted:
        kind = "a classifier (use classify or score)" if info.classifies else "an embedding model (use embed)"
        raise InvalidRequestError(f"{what}: the model {info.architecture} is {kind}", param="model")
