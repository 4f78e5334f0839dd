"""The token embedding table, built from the model's build context."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.layers.build_context import ModelBuildContext
from tokenmill.layers.linear import default_weight_loader


class VocabEmbedding(nn.Embedding):
    """``nn.Embedding`` whose table is created empty in the context's dtype (the
    checkpoint fills it; no random initialisation to pay for), knows its checkpoint
    prefix, and loads through a weight loader like every other parameter. A tied
    lm_head shares its ``weight``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, ctx: ModelBuildContext | None = None) -> None:
        ctx = ctx if ctx is not None else ModelBuildContext(hf_config=None)
        table = torch.empty(num_embeddings, embedding_dim, dtype=ctx.params_dtype)
        super().__init__(num_embeddings, embedding_dim, _weight=table, _freeze=True)
        self.prefix = ctx.prefix
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]
