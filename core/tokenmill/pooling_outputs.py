"""What the pooling runner's API returns: vLLM's ``EmbeddingRequestOutput``,
``ClassificationRequestOutput`` and ``ScoringRequestOutput`` shapes, as one generic record."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Generic, TypeVar


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class ClassificationOutput:
    probs: list[float]  # softmax over the classes
    logits: list[float]  # the head's raw output

    @classmethod
    def from_logits(cls, logits: list[float]) -> ClassificationOutput:
        top = max(logits)
        exps = [math.exp(x - top) for x in logits]
        total = sum(exps)
        return cls([e / total for e in exps], logits)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float  # a cross-encoder's logit (one label), or the cosine similarity of two embeddings


OutputT = TypeVar("OutputT", EmbeddingOutput, ClassificationOutput, ScoringOutput)


@dataclass
class PoolingRequestOutput(Generic[OutputT]):
    request_id: str
    prompt_token_ids: list[int]
    outputs: OutputT
    finished: bool = True

    @property
    def embedding(self) -> list[float]:
        """The embedding (as ``RequestOutput.embedding`` had it), for an embedding output."""
        if not isinstance(self.outputs, EmbeddingOutput):
            raise AttributeError(f"a {type(self.outputs).__name__} has no embedding")
        return self.outputs.embedding


def cosine_similarity(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm > 0 else 0.0
