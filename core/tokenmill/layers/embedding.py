"""The token embedding table, built from the model's build context."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.build_context import ModelBuildContext
from tokenmill.layers.communicator import Communicator
from tokenmill.layers.linear import LinearMethod, UnquantizedLinearMethod, default_weight_loader

if TYPE_CHECKING:
    from tokenmill.layers.linear import Linear


class EmbeddingMethod(Protocol):
    """How a quantized embedding table is stored and looked up (the quantization config's
    ``get_embedding_method``). ``create_weights`` registers the table's parameters on
    ``layer`` in place of the float ``weight`` (each with a ``weight_loader``); an optional
    ``process_weights_after_loading(layer)`` runs once all are loaded; ``tied_head_method``
    is the linear method of an lm_head that multiplies by this same table."""

    def create_weights(self, layer: VocabEmbedding, num_rows: int, embedding_dim: int,
                       params_dtype: torch.dtype) -> None: ...

    def embedding(self, layer: VocabEmbedding, input_ids: torch.Tensor) -> torch.Tensor: ...

    def tied_head_method(self, layer: VocabEmbedding) -> LinearMethod: ...


class VocabEmbedding(nn.Embedding):
    """``nn.Embedding`` whose table is created empty in the context's dtype (the
    checkpoint fills it; no random initialisation to pay for), knows its checkpoint
    prefix, and loads through a weight loader like every other parameter. A tied
    lm_head shares its ``weight``.

    ``parallel``: split the vocabulary over the context's tensor-parallel ranks. Rank
    ``r`` holds rows ``[r * n, (r + 1) * n)`` with ``n = ceil(vocab / world_size)``
    (the last rank's rows past the vocabulary are zero), looks up the ids in its range
    (others give zero vectors) and the all-reduce sums the ranks' lookups: each token's
    vector is one rank's row plus zeros, so it is exact. With one rank it is the whole
    table, looked up as before.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, ctx: ModelBuildContext | None = None,
                 parallel: bool = False) -> None:
        ctx = ctx if ctx is not None else ModelBuildContext(hf_config=None)
        world = ctx.world_size if parallel else 1
        rows = -(-num_embeddings // world)
        method = ctx.quant_config.get_embedding_method(self, ctx.prefix) if ctx.quant_config is not None else None
        # A quantized table replaces `weight`: the float one is only a shape on the meta device.
        table = torch.empty(rows, embedding_dim, dtype=ctx.params_dtype, device="meta" if method else None)
        super().__init__(rows, embedding_dim, _weight=table, _freeze=True)
        self.quant_method: EmbeddingMethod | None = None
        self.prefix = ctx.prefix
        self.vocab_size = num_embeddings
        self.world_size = world
        self.vocab_start = (ctx.rank if world > 1 else 0) * rows
        self.comm: Communicator = ctx.comm
        loader = functools.partial(_load_vocab_rows, self.vocab_start) if world > 1 else default_weight_loader
        self.weight.weight_loader = loader  # type: ignore[attr-defined]
        if method is not None:
            del self.weight
            self.quant_method = method
            method.create_weights(self, rows, embedding_dim, ctx.params_dtype)

    def tied_head_method(self) -> LinearMethod:
        """The linear method of an lm_head tied to this table (then :meth:`tie` it)."""
        return self.quant_method.tied_head_method(self) if self.quant_method is not None else UnquantizedLinearMethod()

    def tie(self, head: Linear) -> None:
        """Make ``head`` multiply by this table: a float table is shared as its ``weight``;
        a quantized one is read by the head's :meth:`tied_head_method`."""
        if self.quant_method is None:
            head.weight = self.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.embedding(self, input_ids)
        if self.world_size == 1:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        inside = (local >= 0) & (local < self.num_embeddings)
        vectors = F.embedding(torch.where(inside, local, 0), self.weight)
        vectors = vectors * inside.unsqueeze(-1).to(vectors.dtype)
        return self.comm.all_reduce(vectors)


def _load_vocab_rows(start: int, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
    """This rank's rows of the checkpoint's ``[vocab, hidden]`` table; rows past the vocabulary stay zero."""
    if shard_id is not None:
        raise ValueError(f"an embedding table has no shards (got shard {shard_id})")
    if loaded.dim() != 2 or loaded.shape[1] != param.shape[1]:
        raise ValueError(f"checkpoint table of shape {tuple(loaded.shape)} for rows of width {param.shape[1]}")
    rows = max(0, min(param.shape[0], loaded.shape[0] - start))
    param.data.zero_()
    param.data[:rows].copy_(loaded[start : start + rows])
