"""The BERT plugin through the conformance kit's pooling variant (a pooling model has no
greedy tokens to compare): CLS, mean and last-token embeddings of tests/bert_models.py's
tiny random BERT against transformers' pooled hidden states."""

from __future__ import annotations

from pathlib import Path

from bert_models import build_bert

from tokenmill.testing.pooling_models import PoolingModelConformance


class TestBertConformance(PoolingModelConformance):
    architecture = "BertModel"

    def build_checkpoint(self, folder: Path) -> Path:
        return build_bert(folder, "BertModel")
