"""The output projection to the vocabulary, split over tensor-parallel ranks."""

from __future__ import annotations

import torch

from tokenmill.layers.build_context import ModelBuildContext
from tokenmill.layers.linear import Linear, LinearMethod


class ParallelLMHead(Linear):
    """``hidden -> logits`` with the vocabulary split over the context's ranks.

    Each rank holds ``ceil(vocab / world_size)`` rows of the head (the rows
    :class:`~tokenmill.layers.embedding.VocabEmbedding` with ``parallel=True`` holds, so a
    tied head shares the rank's table; the last rank's rows past the vocabulary are zero),
    computes its slice of the logits, and the slices are gathered to the group's rank 0 (the
    one that samples) and cut back to the vocabulary; another rank gets its own slice back.
    Every rank must therefore compute logits for the same rows together: the model runner of
    a rank that does not sample mirrors rank 0's calls (and drops them). With one rank it is
    a plain :class:`Linear` of ``vocab`` outputs.
    """

    def __init__(self, hidden_size: int, vocab_size: int, *, bias: bool = False, ctx: ModelBuildContext | None = None,
                 quant_method: LinearMethod | None = None) -> None:
        world = ctx.world_size if ctx is not None else 1
        rows = -(-vocab_size // world) * world
        super().__init__(hidden_size, rows, bias, ctx=ctx, quant_method=quant_method, parallel="column")
        self.vocab_size = vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.quant_method.apply(self, x)
        if self.parallel == "none":
            return logits
        return self.comm.gather(logits, dst=0, dim=-1)[..., : self.vocab_size]
