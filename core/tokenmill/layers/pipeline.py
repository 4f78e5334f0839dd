"""Pipeline parallelism as a model sees it: which of its layers this stage builds, and the
hidden states it receives from the stage before and sends to the stage after.

The build context carries a :class:`PipelineStage` (``ctx.pipeline``). A model plugin builds
its decoder layers with :func:`make_layers` (a :class:`MissingLayer` in place of each layer
another stage holds, so parameter names stay the checkpoint's), builds the embedding only on
the first stage and the final norm and lm_head only on the last (:func:`on_stage`), and in
``forward`` takes its input from :meth:`PipelineStage.receive` on every stage but the first
and hands its output to :meth:`PipelineStage.send` on every stage but the last. Its
``load_weights`` skips the checkpoint tensors of the modules it left out
(:func:`left_out_prefixes`). Each stage's KV cache then holds its own layers only, since the
model runner allocates one per :class:`~tokenmill.layers.attention.Attention` it finds.

The engine core keeps up to ``size`` steps (micro-batches) in flight, so the stages overlap:
:meth:`PipelineStage.send` returns while its tensors travel (stage 0 starts the next
micro-batch while stage 1 runs this one), and the time a stage is blocked in
:meth:`PipelineStage.receive` (or behind a slow next stage) is counted in ``comm.blocked``.

With one stage (the default) every function here builds the whole model and no tensor moves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar, cast

import torch
from torch import nn

from tokenmill.layers.communicator import SINGLE_RANK, Communicator

ModuleT = TypeVar("ModuleT", bound=nn.Module)


class MissingLayer(nn.Module):
    """Stands where a module of another stage would be: no parameters, no computation."""

    def forward(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("a module held by another pipeline stage was called on this one")


@dataclass(frozen=True)
class PipelineStage:
    """Stage ``rank`` of ``size``; ``comm`` links this rank to the same tensor-parallel rank
    of every other stage (its ranks are stage numbers)."""

    rank: int = 0
    size: int = 1
    comm: Communicator = field(default=SINGLE_RANK, compare=False)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def layer_range(self, num_layers: int) -> range:
        """This stage's contiguous share of ``num_layers`` decoder layers; the first
        ``num_layers % size`` stages take one more than the others."""
        share, extra = divmod(num_layers, self.size)
        start = self.rank * share + min(self.rank, extra)
        return range(start, start + share + (1 if self.rank < extra else 0))

    def receive(self, count: int, shape: tuple[int, ...], dtype: torch.dtype,
                device: torch.device) -> list[torch.Tensor]:
        """The ``count`` tensors of ``shape`` the previous stage sent for this step."""
        stacked = torch.empty((count, *shape), dtype=dtype, device=device)
        self.comm.recv(stacked, self.rank - 1)
        return list(stacked.unbind(0))

    def send(self, *tensors: torch.Tensor) -> None:
        """Hand this step's ``tensors`` (of one shape and dtype) to the next stage, as one message,
        and return while it travels: this stage may start its next micro-batch meanwhile."""
        self.comm.send_async(torch.stack(tensors), self.rank + 1)


SINGLE_STAGE = PipelineStage()


def make_layers(num_layers: int, stage: PipelineStage, build: Callable[[int], nn.Module]) -> nn.ModuleList:
    """``build(i)`` for each layer ``i`` of this stage, a :class:`MissingLayer` for the others."""
    owned = stage.layer_range(num_layers)
    return nn.ModuleList(build(i) if i in owned else MissingLayer() for i in range(num_layers))


def on_stage(keep: bool, build: Callable[[], ModuleT]) -> ModuleT:
    """``build()`` where this stage holds the module (``keep``), else a :class:`MissingLayer`
    (typed as the module it stands for, which this stage's forward never calls)."""
    return build() if keep else cast(ModuleT, MissingLayer())


def left_out_prefixes(model: nn.Module) -> tuple[str, ...]:
    """The name prefixes (``model.layers.5.``) of the modules this stage left out: the
    checkpoint tensors under them belong to another stage."""
    return tuple(f"{name}." for name, module in model.named_modules() if isinstance(module, MissingLayer))
