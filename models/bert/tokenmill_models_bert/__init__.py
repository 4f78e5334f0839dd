"""BERT-family model plugin: encoders for the pooling runner (embeddings, cross-encoder scores).

BERT, RoBERTa and XLM-RoBERTa. This module is the entry point: it imports no torch; the
classes load lazily. Every architecture here is encoder-only (``is_generative=False``): its
prompts are prefilled once, bidirectionally, and pooled; nothing is generated.
"""

from typing import Any

from tokenmill.plugin_api import ModelSpec, hookimpl

TOKENMILL_PLUGIN_API = 1

_MODULE = "tokenmill_models_bert.bert"
_ROBERTA = "tokenmill_models_bert.roberta"


def roberta_max_positions(hf_config: Any) -> int:
    """RoBERTa's position rows up to ``pad_token_id`` are never a token's: they are not usable length."""
    return int(hf_config.max_position_embeddings) - int(hf_config.pad_token_id) - 1


@hookimpl
def tokenmill_register_models() -> dict[str, ModelSpec]:
    embed = frozenset({"embed"})
    classify = frozenset({"classify"})
    return {
        # An embedding model pools as its sentence-transformers files say; CLS without them.
        "BertModel": ModelSpec(f"{_MODULE}:BertModel", is_generative=False, default_pooling="cls",
                               capabilities=embed),
        # A cross-encoder: the CLS token through BERT's pooler and the classifier.
        "BertForSequenceClassification": ModelSpec(f"{_MODULE}:BertForSequenceClassification",
                                                   is_generative=False, default_pooling="cls",
                                                   capabilities=classify),
        **{f"{prefix}RobertaModel": ModelSpec(f"{_ROBERTA}:RobertaModel", is_generative=False, default_pooling="cls",
                                              capabilities=embed, max_positions=roberta_max_positions)
           for prefix in ("", "XLM")},
        # A cross-encoder (bge-reranker, ms-marco MiniLM's RoBERTa kin): the <s> state through its head.
        **{f"{prefix}RobertaForSequenceClassification": ModelSpec(
            f"{_ROBERTA}:RobertaForSequenceClassification", is_generative=False, default_pooling="cls",
            capabilities=classify, max_positions=roberta_max_positions) for prefix in ("", "XLM")},
    }
