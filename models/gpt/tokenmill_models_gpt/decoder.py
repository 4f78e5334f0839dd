"""What GPT-2 and GPT-NeoX share: the GELU MLP, the (tied or own) output head, and the load
loop that sends each checkpoint tensor, renamed by the model, through its parameter's loader.

Both are pre-norm decoders with ``nn.LayerNorm`` (weight and bias) where Llama has RMSNorm,
and two biased projections around one activation where Llama gates. The linear layers are
``tokenmill.layers``' own, column- then row-parallel, so the quant-method slot and tensor
parallelism come with them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers import Linear, ModelBuildContext, ParallelLMHead, VocabEmbedding, load_weight
from tokenmill.plugin_api import UnsupportedModelError

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu, "relu": F.relu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's tanh approximation
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}

# (parameter name, tensor, shard index or None) for one checkpoint tensor; none for one the model drops
Renamed = Iterator[tuple[str, torch.Tensor, int | None]]


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise UnsupportedModelError(f"activation {name!r} is not supported; have {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class GeluMLP(nn.Module):
    """``down(act(up(x)))``, both biased; ``up`` splits its columns over the ranks, ``down`` its
    rows. ``names`` are the checkpoint's for the two (GPT-2: ``c_fc``, ``c_proj``), so the
    module tree and the quant prefixes read as the checkpoint does."""

    def __init__(self, hidden: int, inner: int, act: str, ctx: ModelBuildContext, names: tuple[str, str]) -> None:
        super().__init__()
        self.names = names
        up, down = names
        self.add_module(up, Linear(hidden, inner, bias=True, ctx=ctx.child(up), parallel="column"))
        self.add_module(down, Linear(inner, hidden, bias=True, ctx=ctx.child(down), parallel="row"))
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, down = (getattr(self, name) for name in self.names)
        return down(self.act(up(x)))


def output_head(config: Any, embedding: VocabEmbedding, ctx: ModelBuildContext, tied: bool) -> ParallelLMHead:
    """The vocabulary projection: the embedding table itself when ``tied`` (GPT-2), else its own."""
    method = embedding.tied_head_method() if tied else None
    head = ParallelLMHead(config.hidden_size, config.vocab_size, ctx=ctx, quant_method=method)
    if tied:
        embedding.tie(head)
    return head


def load_renamed(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                 rename: Callable[[str, torch.Tensor], Renamed]) -> set[str]:
    """Load each checkpoint tensor as ``rename`` maps it (a fused one may become several
    shards); returns the parameters loaded. A name that maps to no parameter is an error."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for checkpoint_name, tensor in weights:
        for name, part, shard in rename(checkpoint_name, tensor):
            if name not in params:
                raise KeyError(f"checkpoint tensor {checkpoint_name!r} has no parameter {name!r} in "
                               f"{type(model).__name__}")
            load_weight(params[name], part, shard)
            loaded.add(name)
    return loaded
