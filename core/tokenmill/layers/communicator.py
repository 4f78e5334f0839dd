"""Collectives over one tensor-parallel group, as the parallel layers need them.

A :class:`Communicator` wraps a ``torch.distributed`` process group (gloo on the
CPU, NCCL on CUDA: the platform's ``dist_backend``). With ``world_size == 1`` every
call returns its input unchanged and touches no process group, so a model built for
one rank runs exactly as it did before tensor parallelism existed.

Each communicator counts the wall time its collectives take (:class:`CommunicationTime`):
what the step spends in all-reduce and all-gather, waiting for the slowest rank included,
which ``Worker.communication_stats`` reports. On a platform whose collectives are
asynchronous (NCCL) the time is that of the calls' launches only.

Pipeline stages hand hidden states on with :meth:`Communicator.send_async` (``isend``:
the stage goes on to its next micro-batch while the transfer runs) and take them with
:meth:`Communicator.recv`; the time a stage is blocked in either (waiting for its peer) is
counted apart, in ``blocked``: it is the pipeline's bubble as that stage sees it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class CommunicationTime:
    """Cumulative wall time in one communicator's collectives, and how many ran."""

    seconds: float = 0.0
    calls: int = 0


class Communicator:
    """All-reduce (sum), all-gather, broadcast and point-to-point send/recv over ``group``
    (None: the default group). Ranks are ranks within the group. ``max_pending_sends``: how
    many :meth:`send_async` transfers may be under way before the next waits for the oldest."""

    def __init__(self, rank: int = 0, world_size: int = 1, group: Any = None, max_pending_sends: int = 1) -> None:
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.time = CommunicationTime()  # the collectives' (not send/recv's: stages wait there)
        self.blocked = CommunicationTime()  # in send/recv between stages: waiting for the peer
        self._sending: deque[tuple[torch.Tensor, Any]] = deque()  # send_async's tensors and their work
        self.max_pending_sends = max_pending_sends

    @contextmanager
    def _timed(self, counter: CommunicationTime | None = None) -> Iterator[None]:
        counter = self.time if counter is None else counter
        start = time.perf_counter()
        try:
            yield
        finally:
            counter.seconds += time.perf_counter() - start
            counter.calls += 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x`` (in place; returned for chaining)."""
        if self.world_size > 1:
            with self._timed():
                dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim`` in rank order (the ranks' shapes must agree)."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        with self._timed():
            dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def gather(self, x: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor:
        """On rank ``dst``: every rank's ``x`` concatenated along ``dim`` in rank order. On the
        others: their own ``x`` (nothing comes back to them; half the traffic of an all-gather)."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == dst else None
        with self._timed():
            dist.gather(x, parts, dst=self.global_rank(dst), group=self.group)
        return torch.cat(parts, dim=dim) if parts is not None else x

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``x`` on every rank (in place: the others' ``x`` is overwritten)."""
        if self.world_size > 1:
            with self._timed():
                dist.broadcast(x, self.global_rank(src), group=self.group)
        return x

    def send(self, x: torch.Tensor, dst: int) -> None:
        """Send ``x`` to rank ``dst``, which must :meth:`recv` a tensor of its shape and dtype."""
        dist.send(x.contiguous(), self.global_rank(dst), group=self.group)

    def send_async(self, x: torch.Tensor, dst: int) -> None:
        """Start sending ``x`` to rank ``dst`` and return: the transfer runs on the backend's own
        threads, ``x`` kept alive until it is done. With ``max_pending_sends`` transfers still
        under way (the peer has not posted their receives: it is behind), wait for the oldest
        first, so a fast stage runs at most that many micro-batches ahead of the next one."""
        while len(self._sending) >= self.max_pending_sends:
            _, oldest = self._sending.popleft()
            with self._timed(self.blocked):
                oldest.wait()
        x = x.contiguous()
        self._sending.append((x, dist.isend(x, self.global_rank(dst), group=self.group)))

    def recv(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """Receive rank ``src``'s :meth:`send` (or :meth:`send_async`) into ``x`` (returned); the
        wait counts in ``blocked``."""
        work = dist.irecv(x, self.global_rank(src), group=self.group)
        assert work is not None  # None only on a rank outside the group
        with self._timed(self.blocked):
            work.wait()
        return x

    def global_rank(self, rank: int) -> int:
        """torch.distributed names peers by their rank in the default group."""
        return rank if self.group is None else dist.get_global_rank(self.group, rank)


SINGLE_RANK = Communicator()
