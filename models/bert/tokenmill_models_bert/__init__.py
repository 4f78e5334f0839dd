"""BERT-family model plugin: encoders for the pooling runner (embeddings, cross-encoder scores).

This module is the entry point: it imports no torch; the classes load lazily.
Every architecture here is encoder-only (``is_generative=False``): its prompts are
prefilled once, bidirectionally, and pooled; nothing is generated.
"""

from tokenmill.plugin_api import ModelSpec, hookimpl

TOKENMILL_PLUGIN_API = 1

_MODULE = "tokenmill_models_bert.bert"


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
    }
