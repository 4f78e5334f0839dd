"""Collectives over one tensor-parallel group, as the parallel layers need them.

A :class:`Communicator` wraps a ``torch.distributed`` process group (gloo on the
CPU, NCCL on CUDA: the platform's ``dist_backend``). With ``world_size == 1`` every
call returns its input unchanged and touches no process group, so a model built for
one rank runs exactly as it did before tensor parallelism existed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class Communicator:
    """All-reduce (sum), all-gather, broadcast and point-to-point send/recv over ``group``
    (None: the default group). Ranks are ranks within the group."""

    def __init__(self, rank: int = 0, world_size: int = 1, group: Any = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.group = group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x`` (in place; returned for chaining)."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim`` in rank order (the ranks' shapes must agree)."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def gather(self, x: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor:
        """On rank ``dst``: every rank's ``x`` concatenated along ``dim`` in rank order. On the
        others: their own ``x`` (nothing comes back to them; half the traffic of an all-gather)."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == dst else None
        dist.gather(x, parts, dst=self._global(dst), group=self.group)
        return torch.cat(parts, dim=dim) if parts is not None else x

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``x`` on every rank (in place: the others' ``x`` is overwritten)."""
        if self.world_size > 1:
            dist.broadcast(x, self._global(src), group=self.group)
        return x

    def send(self, x: torch.Tensor, dst: int) -> None:
        """Send ``x`` to rank ``dst``, which must :meth:`recv` a tensor of its shape and dtype."""
        dist.send(x.contiguous(), self._global(dst), group=self.group)

    def recv(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """Receive rank ``src``'s :meth:`send` into ``x`` (returned)."""
        dist.recv(x, self._global(src), group=self.group)
        return x

    def _global(self, rank: int) -> int:
        """torch.distributed names peers by their rank in the default group."""
        return rank if self.group is None else dist.get_global_rank(self.group, rank)


SINGLE_RANK = Communicator()
