"""Which cores each worker rank of one machine may run on (CPU binding).

Two ranks that share every core fight over them: each rank's OpenMP team is sized for
its share of the cores, but the scheduler moves threads freely, so a rank's threads
land on its peer's cores, evict its caches and stall the all-reduce both wait in. Each
rank is therefore pinned to its own cores, a contiguous slice of the cores the engine's
process may use (``os.sched_getaffinity``), and runs as many threads as its slice has
cores (or fewer, where the engine was asked for fewer threads in all).

The worker process pins itself (:func:`bind_to_cores`) before its platform sets torch's
thread count, so the OpenMP team starts on its own cores. ``TOKENMILL_CPU_BINDING=0``
turns binding off: every rank then keeps the engine's affinity and its share of the
threads, as before binding existed.
"""

from __future__ import annotations

import os

BINDING_ENV = "TOKENMILL_CPU_BINDING"


def binding_enabled() -> bool:
    """Whether ranks are pinned: on unless ``TOKENMILL_CPU_BINDING`` is 0/off/false/no."""
    return os.environ.get(BINDING_ENV, "1").strip().lower() not in {"0", "off", "false", "no"}


def allowed_cores() -> list[int] | None:
    """The cores this process may run on, in order; None where the OS cannot say (not Linux)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:
        return None


def rank_core_sets(cores: list[int], world_size: int) -> list[frozenset[int]]:
    """Each rank's cores: ``cores`` cut into ``world_size`` contiguous slices (the first
    ranks take one more where they do not divide evenly). With fewer cores than ranks no
    slice can be a rank's alone: rank ``r`` gets core ``r mod len(cores)``, so the ranks at
    least spread evenly over the cores there are."""
    if not cores:
        raise ValueError("no cores to bind the ranks to")
    if len(cores) < world_size:
        return [frozenset({cores[rank % len(cores)]}) for rank in range(world_size)]
    share, extra = divmod(len(cores), world_size)
    sets, start = [], 0
    for rank in range(world_size):
        end = start + share + (1 if rank < extra else 0)
        sets.append(frozenset(cores[start:end]))
        start = end
    return sets


def plan_binding(world_size: int, threads: int) -> tuple[list[frozenset[int] | None], int]:
    """Every rank's cores (None: not pinned) and its thread count, for ranks on this
    machine. ``threads`` is each rank's share of the engine's threads; a pinned rank runs at
    most as many as it has cores, since more would only take turns on them."""
    cores = allowed_cores() if binding_enabled() else None
    if cores is None:
        return [None] * world_size, threads
    sets = rank_core_sets(cores, world_size)
    return list(sets), max(1, min(threads, min(len(s) for s in sets)))


def bind_to_cores(cores: frozenset[int] | None) -> None:
    """Pin this process (every thread it starts afterwards) to ``cores``; None leaves it be."""
    if cores is not None:
        os.sched_setaffinity(0, cores)
