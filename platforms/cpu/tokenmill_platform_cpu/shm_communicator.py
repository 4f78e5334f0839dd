"""Collectives through shared memory for the tensor-parallel ranks of one machine.

Over gloo a collective is a round trip through loopback TCP and gloo's own threads,
~1.8 ms each on a 2-core VM: at 26 per decode step that is most of a small batch's step.
Ranks on one machine can instead meet in one shared-memory segment per group: each rank
copies its tensor into its own slot, raises its sequence number, waits until every rank
has raised its own to the same number, and reads the others' slots (an all-reduce sums
them, in rank order on every rank, so every rank gets bit-identical sums).

The segment: one 64-byte line per rank holding its sequence number, then two buffers of
``world_size`` slots each. Collective ``n`` uses buffer ``n % 2``; a rank writes buffer
``n % 2`` again only at ``n + 2``, after it saw every rank reach ``n + 1``, which each rank
does only once it has finished reading ``n``'s slots: so no slot is overwritten while a peer
still reads it, with no second handshake. Every collective waits for every rank (gather
and broadcast too), which keeps that argument true for each of them.

Ordering: a rank's tensor is stored before its sequence number, and a peer loads the
number before the tensor; x86-64 keeps stores in order and loads in order (TSO), which is
all this needs. Elsewhere (aarch64 reorders them, and Python has no fence) the group keeps
gloo.

Waiting: a rank sleeps on the peer's number as a futex (futex.py), which the peer's post
wakes: a rank whose peer is not running (a busy machine, or more ranks than cores) leaves the
core at once and wakes the moment the peer posts. It may first spin on the numbers for
``TOKENMILL_CPU_SHM_SPIN_US`` microseconds (default 0), which saves the futex's wake-up where
each rank has a core to itself; measured on a loaded machine (load average 7-12 on 2 cores), a
50 µs spin made TP=2's decode steps 30% slower than gloo's, no spin made them equal with 25% less
time in collectives (docs/benchmarks.md). (Growing naps instead of the futex were ~3x slower
than gloo: each nap overshoots the post.) Each sleep ends after ``LIVENESS_SECONDS`` to check that the peers'
processes live: a peer that died fails the collective with an error (the executor then fails
the engine, as gloo's closed socket made it).

Gloo stays the fallback, per call: a tensor larger than a slot (``TOKENMILL_CPU_SHM_COMM_BYTES``,
default 8 MiB: a decode step's all-reduce is kilobytes, its logits' gather megabytes; a long
prefill chunk's all-reduce may take gloo), or not contiguous. Per group: a group whose ranks
cannot all open the segment (a Ray group spanning machines), no ``/dev/shm``, another CPU
architecture, or ``TOKENMILL_CPU_SHM_COMM=0``. Every rank decides alike (the shapes agree),
so a group never mixes paths within one collective.

The segment's file is unlinked as soon as every rank has mapped it: it lives as long as the
mappings, so no process exit, not even a SIGKILL, leaves it in ``/dev/shm``.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import platform
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tokenmill.layers import Communicator
from tokenmill.plugin_api import parse_size, process_alive
from tokenmill_platform_cpu.futex import futex_available, futex_wait, futex_wake

logger = logging.getLogger(__name__)

ENABLE_ENV = "TOKENMILL_CPU_SHM_COMM"
SLOT_BYTES_ENV = "TOKENMILL_CPU_SHM_COMM_BYTES"
DEFAULT_SLOT_BYTES = 8 << 20
SHM_DIR = Path("/dev/shm")
NAME_PREFIX = "tokenmill-comm-"
LINE = 64  # bytes per rank's sequence number: one cache line, so ranks never write one line
HEADER = 4096  # the sequence numbers' page; the slots start page-aligned after it
SPIN_ENV = "TOKENMILL_CPU_SHM_SPIN_US"
LIVENESS_SECONDS = 0.1
SEQUENCE_MASK = 0x7FFFFFFF  # sequence numbers are int32 futex words: they wrap, compared for equality
_ORDERED_STORES = {"x86_64", "amd64", "i386", "i686"}


def shm_enabled() -> bool:
    """On unless ``TOKENMILL_CPU_SHM_COMM`` is 0/off/false/no, on a CPU that keeps stores in order."""
    if os.environ.get(ENABLE_ENV, "1").strip().lower() in {"0", "off", "false", "no"}:
        return False
    return platform.machine().lower() in _ORDERED_STORES and SHM_DIR.is_dir() and futex_available()


def spin_seconds() -> float:
    """How long a waiting rank spins before it sleeps (``TOKENMILL_CPU_SHM_SPIN_US``, default 0)."""
    return max(0.0, float(os.environ.get(SPIN_ENV, "0"))) * 1e-6


def slot_bytes() -> int:
    """The largest tensor one rank may put through the segment (bytes, rounded up to a line)."""
    configured = os.environ.get(SLOT_BYTES_ENV)
    size = parse_size(configured) if configured is not None else DEFAULT_SLOT_BYTES
    return max(LINE, -(-size // LINE) * LINE)


class PeerDied(RuntimeError):
    """A rank of the group exited while this one waited for it in a collective."""


class SharedSegment:
    """One group's mapped segment: the ranks' sequence numbers and their slots."""

    def __init__(self, mapping: mmap.mmap, world_size: int, slot_size: int) -> None:
        self.mapping = mapping
        self.world_size = world_size
        self.slot_size = slot_size
        self.sequence = memoryview(mapping)[:HEADER].cast("i")  # rank r's number at index r * LINE // 4
        self._base = ctypes.c_char.from_buffer(mapping)  # for the numbers' addresses (futexes)
        self.addresses = [ctypes.addressof(self._base) + r * LINE for r in range(world_size)]
        data = torch.frombuffer(mapping, dtype=torch.uint8, offset=HEADER, count=2 * world_size * slot_size)
        self.slots = data.view(2, world_size, slot_size)

    @staticmethod
    def size(world_size: int, slot_size: int) -> int:
        return HEADER + 2 * world_size * slot_size

    def close(self) -> None:
        self.sequence.release()
        del self.slots, self._base
        with contextlib.suppress(BufferError):  # a tensor still viewing it keeps it mapped until collected
            self.mapping.close()


def create_shm_communicator(rank: int, world_size: int, group: Any = None) -> Communicator:
    """The group's communicator: through a shared segment where every rank of ``group`` could
    map it, else the gloo one. Collective: every rank of the group calls it at one point."""
    base = Communicator(rank, world_size, group)
    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return base
    wanted = shm_enabled()
    # Whether every rank wants it (the environment could differ across machines): one answer for all
    votes: list[Any] = [None] * world_size
    dist.all_gather_object(votes, wanted, group=group)
    if not all(votes):
        logger.info("tensor-parallel group of %d: collectives over %s (%s=0 or no shared memory on some rank)",
                    world_size, dist.get_backend(group), ENABLE_ENV)
        return base
    size = slot_bytes()
    path: list[Any] = [SHM_DIR / f"{NAME_PREFIX}{os.getpid()}-{uuid.uuid4().hex}" if rank == 0 else None]
    segment: SharedSegment | None = None
    try:
        if rank == 0:
            _create_file(path[0], SharedSegment.size(world_size, size))
        dist.broadcast_object_list(path, src=base.global_rank(0), group=group)
        with contextlib.suppress(OSError, ValueError):
            segment = _map(path[0], world_size, size)
        answers: list[Any] = [None] * world_size
        dist.all_gather_object(answers, (segment is not None, os.getpid()), group=group)
    finally:
        if rank == 0:  # every rank has mapped it or given up: the name is no longer needed
            with contextlib.suppress(OSError):
                os.unlink(path[0])
    if not all(mapped for mapped, _ in answers):
        if segment is not None:
            segment.close()
        logger.info("tensor-parallel group of %d: collectives over %s (not every rank could map %s: "
                    "ranks on several machines)", world_size, dist.get_backend(group), SHM_DIR)
        return base
    assert segment is not None
    logger.info("tensor-parallel group of %d: collectives through shared memory (%s per slot; larger over %s)",
                world_size, _mib(size), dist.get_backend(group))
    return ShmCommunicator(rank, world_size, group, segment, [pid for _, pid in answers])


def _create_file(path: Path, size: int) -> None:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)  # sparse on tmpfs: pages are allocated where the slots are written
    finally:
        os.close(fd)


def _map(path: Path, world_size: int, size: int) -> SharedSegment:
    fd = os.open(path, os.O_RDWR)
    try:
        mapping = mmap.mmap(fd, SharedSegment.size(world_size, size))
    finally:
        os.close(fd)  # the mapping keeps the file
    return SharedSegment(mapping, world_size, size)


def _mib(size: int) -> str:
    return f"{size / (1 << 20):g} MiB"


class ShmCommunicator(Communicator):
    """All-reduce, all-gather, gather and broadcast through ``segment``; send/recv and what
    does not fit a slot through the group's gloo (the base class). ``pids``: every rank's
    process, to tell a dead peer from a slow one."""

    def __init__(self, rank: int, world_size: int, group: Any, segment: SharedSegment, pids: list[int]) -> None:
        super().__init__(rank, world_size, group)
        self.segment = segment
        self.pids = pids
        self.calls = 0  # this rank's sequence number: collectives run through the segment
        self.fallbacks = 0  # collectives that went over gloo instead (too large, not contiguous)
        self.spin = spin_seconds()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if not self._fits(x):
            return super().all_reduce(x)
        with self._timed():
            slots = self._exchange(x)
            torch.add(slots[0], slots[1], out=x)
            for slot in slots[2:]:
                x.add_(slot)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if not self._fits(x):
            return super().all_gather(x, dim)
        with self._timed():
            return torch.cat(self._exchange(x), dim=dim)

    def gather(self, x: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor:
        if not self._fits(x):
            return super().gather(x, dst, dim)
        with self._timed():
            slots = self._exchange(x)
            return torch.cat(slots, dim=dim) if self.rank == dst else x

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        if not self._fits(x):
            return super().broadcast(x, src)
        with self._timed():
            slots = self._exchange(x, write=self.rank == src)
            if self.rank != src:
                x.copy_(slots[src])
        return x

    def _fits(self, x: torch.Tensor) -> bool:
        fits = x.is_contiguous() and x.numel() * x.element_size() <= self.segment.slot_size
        if not fits:
            self.fallbacks += 1
        return fits

    def _exchange(self, x: torch.Tensor, write: bool = True) -> list[torch.Tensor]:
        """Put ``x`` in this rank's slot, wait for every rank to have put theirs, and return
        every rank's slot viewed as ``x`` (valid until this rank's next-but-one collective)."""
        self.calls += 1
        buffer = self.segment.slots[self.calls % 2]
        nbytes = x.numel() * x.element_size()
        views = [buffer[r, :nbytes].view(x.dtype).view(x.shape) for r in range(self.world_size)]
        if write:
            views[self.rank].copy_(x)
        self.segment.sequence[self.rank * LINE // 4] = self.calls & SEQUENCE_MASK  # after the tensor: stores stay in order
        futex_wake(self.segment.addresses[self.rank])
        self._wait_for_peers((self.calls - 1) & SEQUENCE_MASK)
        return views

    def _wait_for_peers(self, before: int) -> None:
        """Until no rank's sequence number is still ``before`` (the previous collective's; a
        peer is then at this one, or already at the next): spin (if asked to), then sleep on it."""
        sequence = self.segment.sequence
        waiting = [r for r in range(self.world_size) if r != self.rank]
        start = time.perf_counter() if self.spin else 0.0
        while True:
            waiting = [r for r in waiting if sequence[r * LINE // 4] == before]
            if not waiting:
                return
            if self.spin and time.perf_counter() - start < self.spin:
                continue
            futex_wait(self.segment.addresses[waiting[0]], before, LIVENESS_SECONDS)
            if sequence[waiting[0] * LINE // 4] == before:  # the sleep timed out (or a signal ended it)
                self._check_peers(waiting)

    def _check_peers(self, ranks: list[int]) -> None:
        for rank in ranks:
            if not process_alive(self.pids[rank]):
                raise PeerDied(f"tensor-parallel rank {rank} (pid {self.pids[rank]}) exited during a collective "
                               f"of rank {self.rank}")
