"""BERT: absolute position and token type embeddings, post-norm encoder layers with
bidirectional attention, and no KV cache.

Token types: a cross-encoder's input is a pair, ``[CLS] a [SEP] b [SEP]``, whose
second segment has token type 1. The engine passes token ids only, so the type is
recovered from them as the tokenizer assigns it: every token after a sequence's
first ``[SEP]`` is type 1. (A first text holding a literal ``[SEP]`` would be typed
differently from the tokenizer's segment split; tokenizers escape none, so keep it out.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers import EncoderBatch, Linear, MergedLinear, ModelBuildContext, bidirectional_attention, load_weight
from tokenmill.plugin_api import AttentionMetadata, UnsupportedModelError

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"gelu": F.gelu, "relu": F.relu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
_QKV = {"query": 0, "key": 1, "value": 2}


class BertEmbeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor) -> torch.Tensor:
        hidden = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        return self.LayerNorm(hidden + self.token_type_embeddings(token_types))


class BertSelfAttention(nn.Module):
    def __init__(self, config: Any, ctx: ModelBuildContext) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_size = config.hidden_size // self.num_heads
        self.qkv = MergedLinear(config.hidden_size, [config.hidden_size] * 3, bias=True, ctx=ctx.child("qkv"))
        self.scale = self.head_size**-0.5

    def forward(self, hidden: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        tokens = hidden.shape[0]
        q, k, v = (x.reshape(tokens, self.num_heads, self.head_size) for x in self.qkv.split(self.qkv(hidden)))
        return bidirectional_attention(q, k, v, batch, self.scale).reshape(tokens, -1)


class BertAddNorm(nn.Module):
    """A projection, then LayerNorm of it plus the residual (BERT is post-norm)."""

    def __init__(self, in_features: int, config: Any, ctx: ModelBuildContext) -> None:
        super().__init__()
        self.dense = Linear(in_features, config.hidden_size, bias=True, ctx=ctx.child("dense"))
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: Any, ctx: ModelBuildContext) -> None:
        super().__init__()
        self.self = BertSelfAttention(config, ctx.child("self"))
        self.output = BertAddNorm(config.hidden_size, config, ctx.child("output"))

    def forward(self, hidden: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        return self.output(self.self(hidden, batch), hidden)


class BertIntermediate(nn.Module):
    def __init__(self, config: Any, ctx: ModelBuildContext) -> None:
        super().__init__()
        self.dense = Linear(config.hidden_size, config.intermediate_size, bias=True, ctx=ctx.child("dense"))
        if config.hidden_act not in _ACTIVATIONS:
            raise UnsupportedModelError(f"BERT hidden_act {config.hidden_act!r} is not supported; "
                                        f"have {sorted(_ACTIVATIONS)}")
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, config: Any, ctx: ModelBuildContext) -> None:
        super().__init__()
        self.attention = BertAttention(config, ctx.child("attention"))
        self.intermediate = BertIntermediate(config, ctx.child("intermediate"))
        self.output = BertAddNorm(config.intermediate_size, config, ctx.child("output"))

    def forward(self, hidden: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        hidden = self.attention(hidden, batch)
        return self.output(self.intermediate(hidden), hidden)


class _Layers(nn.Module):
    """``encoder.layer.N`` of the checkpoint."""

    def __init__(self, config: Any, ctx: ModelBuildContext) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config, ctx.child(f"layer.{i}")) for i in range(config.num_hidden_layers))


class _Pooler(nn.Module):
    """``pooler.dense`` of the checkpoint: BERT's CLS projection, followed by tanh."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(x))


class BertEncoder(nn.Module):
    """Embeddings and layers: the final hidden state of every token (what ``BertModel`` returns
    as ``last_hidden_state``)."""

    embeddings_class: type[BertEmbeddings] = BertEmbeddings
    pairs_have_token_types = True  # a pair's second segment is type 1 (RoBERTa's tokenizers give none)

    def __init__(self, config: Any, ctx: ModelBuildContext) -> None:
        super().__init__()
        if ctx.world_size > 1:
            raise UnsupportedModelError("BERT models run on one rank (tensor_parallel_size 1)")
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            raise UnsupportedModelError(f"BERT position_embedding_type {config.position_embedding_type!r}: only "
                                        "absolute position embeddings are supported")
        self.embeddings = self.embeddings_class(config)
        self.encoder = _Layers(config, ctx.child("encoder"))
        typed = self.pairs_have_token_types and config.type_vocab_size > 1
        self.sep_token_id = _sep_token_id(config) if typed else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        batch = EncoderBatch.from_metadata(metadata, input_ids.device)
        hidden = self.embeddings(input_ids, positions, self._token_types(input_ids, metadata))
        for layer in self.encoder.layer:
            hidden = layer(hidden, batch)
        return hidden

    def _token_types(self, input_ids: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """1 after each sequence's first [SEP], 0 up to it (see the module docstring)."""
        if self.sep_token_id is None:
            return torch.zeros_like(input_ids)
        is_sep = (input_ids == self.sep_token_id).long()
        seps_through = torch.cumsum(is_sep, 0)
        starts = metadata.query_start_loc[:-1]
        lens = metadata.query_start_loc[1:] - starts
        # SEPs before each sequence's first token, repeated over its tokens
        before = torch.repeat_interleave((seps_through - is_sep)[starts], lens, output_size=input_ids.shape[0])
        return ((seps_through - is_sep - before) > 0).long()


def _sep_token_id(config: Any) -> int:
    """The [SEP] id: the config's, else the tokenizer's in the model's folder."""
    sep = getattr(config, "sep_token_id", None)
    if sep is None:
        from transformers import AutoTokenizer

        try:
            sep = AutoTokenizer.from_pretrained(config._name_or_path).sep_token_id
        except (OSError, ValueError) as exc:
            raise UnsupportedModelError(f"no [SEP] id in the config or a tokenizer of {config._name_or_path!r}: "
                                        f"token types cannot be told ({exc})") from exc
    if sep is None:
        raise UnsupportedModelError("the tokenizer has no [SEP] token: BERT token types cannot be told")
    return int(sep)


class _BertBase(nn.Module):
    """Shared loading: checkpoint names under ``prefix`` map onto ``self.bert``; q/k/v merge into one matmul."""

    checkpoint_prefix = ""  # where the encoder's tensors start in the checkpoint ("bert." under a head)
    ignored: tuple[str, ...] = ("embeddings.position_ids",)
    encoder_class: type[BertEncoder] = BertEncoder

    def __init__(self, config: Any, ctx: ModelBuildContext) -> None:
        super().__init__()
        self.config = config
        self.bert = self.encoder_class(config, ctx.child("bert"))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        return self.bert(input_ids, positions, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise UnsupportedModelError(f"{type(self).__name__} is an encoder: it computes no token logits")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            target = self._parameter_name(name)
            if target is None:
                continue
            name, shard = target
            if name not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no parameter in {type(self).__name__}")
            load_weight(params[name], tensor, shard)
            loaded.add(name)
        return loaded

    def _parameter_name(self, name: str) -> tuple[str, int | None] | None:
        """This model's parameter (and q/k/v shard) for a checkpoint name; None for one it does not use."""
        if not name.startswith(self.checkpoint_prefix):
            return self._head_parameter(name)
        name = name.removeprefix(self.checkpoint_prefix)
        if name in self.ignored or (name.startswith("pooler.") and not self._uses_pooler()):
            return None
        if name.startswith("pooler."):
            return name, None
        module, _, leaf = name.rpartition(".")
        owner, _, proj = module.rpartition(".")
        if proj in _QKV and owner.endswith("attention.self"):
            return f"bert.{owner}.qkv.{leaf}", _QKV[proj]
        return f"bert.{name}", None

    def _uses_pooler(self) -> bool:
        return False

    def _head_parameter(self, name: str) -> tuple[str, int | None] | None:
        return None


class BertModel(_BertBase):
    """``BertModel`` as sentence-transformers uses it: the final hidden states, pooled by the
    engine (its pooler layer is not used, so its weights are not loaded)."""


class BertForSequenceClassification(_BertBase):
    """A cross-encoder or classifier: ``classifier(tanh(pooler(h_CLS)))``; the engine pools the
    CLS token and :meth:`compute_pooled` applies the head."""

    checkpoint_prefix = "bert."

    def __init__(self, config: Any, *, ctx: ModelBuildContext) -> None:
        super().__init__(config, ctx)
        self.pooler = _Pooler(config.hidden_size)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def compute_pooled(self, pooled: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` CLS states -> ``[N, num_labels]`` logits."""
        return self.classifier(self.pooler(pooled))

    def _uses_pooler(self) -> bool:
        return True

    def _head_parameter(self, name: str) -> tuple[str, int | None] | None:
        return (name, None) if name.startswith("classifier.") else None
