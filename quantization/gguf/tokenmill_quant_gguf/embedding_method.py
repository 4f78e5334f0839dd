"""The GGUF token embedding: the table kept in the file's blocks, rows dequantised as looked up.

The loader gives ``model.embed_tokens`` as ``qweight_type`` and ``qweight`` like a
linear weight. A table of a kept type (Q4_0 .. Q8_0, Q4_K, Q5_K, Q6_K) stays in its blocks: a lookup dequantises
only the rows of the ids asked for (exactly what the gguf package gives for them),
and a tied lm_head multiplies by the same blocks through the GGUF kernel, so the
vocabulary, the largest matrix of a small model, is held once and quantized. Any
other type is dequantised into a float table at load.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from tokenmill.layers import Linear, VocabEmbedding, layer_ops
from tokenmill_quant_gguf.blocks import KEPT_QUANTIZED, dequantize_rows, row_bytes
from tokenmill_quant_gguf.kernels import Activations, gguf_embedding, gguf_linear


class GGUFEmbeddingMethod:
    """One embedding table's GGUF blocks (``dequantize``: always a float table; ``activations``: how
    a tied lm_head's input meets them, as :class:`~tokenmill_quant_gguf.linear_method.GGUFLinearMethod`'s)."""

    def __init__(self, dequantize: bool = False, activations: Activations = "auto") -> None:
        self.dequantize = dequantize
        self.activations: Activations = activations
        self.qtype: GGMLQuantizationType | None = None  # set when the table keeps its blocks
        self._type: GGMLQuantizationType | None = None
        self._rows: torch.Tensor | None = None

    def create_weights(self, layer: VocabEmbedding, num_rows: int, embedding_dim: int,
                       params_dtype: torch.dtype) -> None:
        self.params_dtype = params_dtype
        for name, load in (("qweight_type", self._load_type), ("qweight", self._load_rows)):
            param = nn.Parameter(torch.empty(0, dtype=torch.uint8 if name == "qweight" else torch.int64),
                                 requires_grad=False)
            param.weight_loader = _bound(layer, load)  # type: ignore[attr-defined]
            layer.register_parameter(name, param)

    def _load_type(self, layer: VocabEmbedding, loaded: torch.Tensor) -> None:
        self._type = GGMLQuantizationType(int(loaded.item()))

    def _load_rows(self, layer: VocabEmbedding, loaded: torch.Tensor) -> None:
        if self._type is None:
            raise ValueError(f"{layer.prefix}: the table's rows came before its qweight_type")
        expected = (layer.num_embeddings, row_bytes(self._type, layer.embedding_dim))
        if layer.world_size > 1:  # this rank's rows; past the vocabulary, zero bytes: zero values
            rows = loaded[layer.vocab_start : layer.vocab_start + layer.num_embeddings]
            loaded = torch.cat([rows, rows.new_zeros(layer.num_embeddings - rows.shape[0], rows.shape[1])])
        if tuple(loaded.shape) != expected:
            raise ValueError(f"{layer.prefix}: {self._type.name} rows of shape {tuple(loaded.shape)} for a table of "
                             f"{layer.num_embeddings} rows of {layer.embedding_dim} values")
        self._rows = loaded.contiguous()

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        table = cast(VocabEmbedding, layer)
        if self._rows is None or self._type is None:
            raise ValueError(f"{table.prefix}: no GGUF rows loaded for the embedding table")
        del table.qweight_type, table.qweight
        if self._type in KEPT_QUANTIZED and not self.dequantize:
            self.qtype = self._type
            table.register_buffer("qweight", self._rows)
        else:
            weight = dequantize_rows(self._rows, self._type, table.embedding_dim).to(self.params_dtype)
            table.weight = nn.Parameter(weight, requires_grad=False)  # a float table, as without a method
            table.register_buffer("prepared_weight", layer_ops(weight.device).prepare_linear_weight(weight),
                                  persistent=False)
        self._rows = None

    def embedding(self, layer: VocabEmbedding, input_ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``input_ids``; over several ranks each looks up the ids in its range
        (zero vectors for the others) and the all-reduce sums them, as the float table does."""
        if layer.world_size == 1:  # computes nothing but the lookup, so a step graph records it
            return self._rows_of(layer, input_ids)
        local = input_ids - layer.vocab_start
        inside = (local >= 0) & (local < layer.num_embeddings)
        values = self._rows_of(layer, torch.where(inside, local, 0))
        return layer.comm.all_reduce(values * inside.unsqueeze(-1).to(values.dtype))

    def _rows_of(self, layer: VocabEmbedding, ids: torch.Tensor) -> torch.Tensor:
        if self.qtype is None:
            return F.embedding(ids, cast(torch.Tensor, layer.weight))
        values = gguf_embedding(cast(torch.Tensor, layer.qweight), ids.reshape(-1), self.qtype, layer.embedding_dim)
        if values.dtype != self.params_dtype:
            values = values.to(self.params_dtype)
        return values.reshape(*ids.shape, layer.embedding_dim)

    def tied_head_method(self, layer: VocabEmbedding) -> TiedGGUFHeadMethod:
        return TiedGGUFHeadMethod(layer, self)


class TiedGGUFHeadMethod:
    """An lm_head tied to a GGUF embedding: no weights of its own, it multiplies by the table's."""

    def __init__(self, table: VocabEmbedding, table_method: GGUFEmbeddingMethod) -> None:
        self._table = [table]  # a list: not registered as the head's submodule
        self._table_method = table_method

    def create_weights(self, layer: Linear, input_size: int, output_partition_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        pass

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        table = self._table[0]
        qtype = self._table_method.qtype
        if qtype is None:
            return layer_ops(x.device).linear(x, cast(torch.Tensor, table.weight), None,
                                              cast(torch.Tensor | None, table.prepared_weight))
        return gguf_linear(x, cast(torch.Tensor, table.qweight), qtype, table.embedding_dim,
                           activations=self._table_method.activations)


def _bound(layer: VocabEmbedding, load):  # type: ignore[no-untyped-def]
    def weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{layer.prefix}: an embedding table has no shards (got shard {shard_id})")
        load(layer, loaded)
    return weight_loader
