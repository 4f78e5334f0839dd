"""The token embedding table, built from the model's build context."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.build_context import ModelBuildContext
from tokenmill.layers.communicator import Communicator
from tokenmill.layers.linear import default_weight_loader


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
        table = torch.empty(rows, embedding_dim, dtype=ctx.params_dtype)
        super().__init__(rows, embedding_dim, _weight=table, _freeze=True)
        self.prefix = ctx.prefix
        self.vocab_size = num_embeddings
        self.world_size = world
        self.vocab_start = (ctx.rank if world > 1 else 0) * rows
        self.comm: Communicator = ctx.comm
        loader = functools.partial(_load_vocab_rows, self.vocab_start) if world > 1 else default_weight_loader
        self.weight.weight_loader = loader  # type: ignore[attr-defined]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
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
