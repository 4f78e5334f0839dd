"""RoBERTa and XLM-RoBERTa: BERT's encoder with two differences that change the numbers.

- Positions are offset: RoBERTa numbers a sequence's tokens from ``pad_token_id + 1``
  (the rows below belong to padding), so the engine's position ``p`` reads row
  ``p + pad_token_id + 1`` of the table, and a sequence may use only
  ``max_position_embeddings - pad_token_id - 1`` positions (the plugin's
  ``ModelSpec.max_positions`` tells the engine).
- No token types: the tokenizers pair texts as ``<s> a </s></s> b </s>`` and give no
  segment ids, so every token has type 0 (the table usually has one row).

The sequence-classification head (a cross-encoder) reads the ``<s>`` state through its own
``dense -> tanh -> out_proj``, not BERT's pooler. XLM-RoBERTa has the same layout and names.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.layers import ModelBuildContext
from tokenmill_models_bert.bert import BertEmbeddings, BertEncoder, _BertBase


def roberta_position_offset(config: Any) -> int:
    return int(config.pad_token_id) + 1


class RobertaEmbeddings(BertEmbeddings):
    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.position_offset = roberta_position_offset(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids, positions + self.position_offset, token_types)


class RobertaEncoder(BertEncoder):
    embeddings_class = RobertaEmbeddings
    pairs_have_token_types = False


class RobertaModel(_BertBase):
    """``RobertaModel`` / ``XLMRobertaModel``: final hidden states, pooled by the engine (the
    checkpoint's pooler layer is not used)."""

    encoder_class = RobertaEncoder
    ignored = ("embeddings.position_ids", "embeddings.token_type_ids")


class _ClassificationHead(nn.Module):
    """``classifier.dense`` and ``classifier.out_proj`` of the checkpoint."""

    def __init__(self, hidden_size: int, num_labels: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.out_proj = nn.Linear(hidden_size, num_labels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(x)))


class RobertaForSequenceClassification(RobertaModel):
    """A cross-encoder or classifier: the engine pools the ``<s>`` (first) token and
    :meth:`compute_pooled` applies the head."""

    checkpoint_prefix = "roberta."

    def __init__(self, config: Any, *, ctx: ModelBuildContext) -> None:
        super().__init__(config, ctx)
        self.classifier = _ClassificationHead(config.hidden_size, config.num_labels)

    def compute_pooled(self, pooled: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` first-token states -> ``[N, num_labels]`` logits."""
        return self.classifier(pooled)

    def _head_parameter(self, name: str) -> tuple[str, int | None] | None:
        return (name, None) if name.startswith("classifier.") else None
