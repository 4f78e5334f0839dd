"""Which logical expert each physical slot of a MoE layer holds, from the measured load.

A placement is a list ``physical_to_logical`` of ``num_ranks * slots_per_rank`` logical expert
ids: rank ``r`` holds slots ``[r * S, (r + 1) * S)``. Every logical expert has at least one slot;
an expert with ``c`` slots (copies) gets each of its tokens routed to one of them, the copies
sharing its load evenly (:mod:`tokenmill.layers.expert_replicas`), so a copy's load is the
expert's over ``c`` and a rank's load is the sum over its slots.

:func:`balanced_placement` builds one in three steps, each plain and deterministic (every rank
computes the same answer from the same load, with no communication):

1. copies: one per expert, then each redundant slot to the expert whose copies are the most
   loaded (its load over its copies), at most one copy per rank;
2. packing: the copies, heaviest first, each onto the least loaded rank with a free slot that
   does not hold that expert yet (longest-processing-time greedy; ties go to a rank that
   already held the expert, so fewer weights move);
3. slots: on each rank an expert it already held stays in its slot, the rest fill the free ones.

:func:`plan_moves` says which weights a change of placement copies, from which rank and slot.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

Placement = list[int]  # physical slot -> logical expert id


def initial_placement(num_experts: int, num_ranks: int, slots_per_rank: int) -> Placement:
    """Before any load is measured: slot ``p`` holds expert ``p mod E`` (rank 0 the first
    experts, the redundant slots of the last ranks copies of the first ones again)."""
    return [slot % num_experts for slot in range(num_ranks * slots_per_rank)]


def replica_counts(load: Sequence[float], num_physical: int, max_copies: int) -> list[int]:
    """Copies of each logical expert, ``num_physical`` in all: one each, then every further slot to
    the expert with the highest load per copy (ties: the lower id), none over ``max_copies``."""
    counts = [1] * len(load)
    for _ in range(num_physical - len(load)):
        open_experts = [e for e in range(len(load)) if counts[e] < max_copies]
        hottest = max(open_experts, key=lambda e: (load[e] / counts[e], -e))
        counts[hottest] += 1
    return counts


def pack_copies(load: Sequence[float], counts: Sequence[int], num_ranks: int, slots_per_rank: int,
                current: Sequence[int] | None = None) -> list[list[int]]:
    """The logical experts each rank holds (``counts[e]`` copies of ``e`` over all ranks), the
    ranks' loads as even as the greedy gets them. ``current``: the placement now, whose holders
    win ties (so an unchanged load keeps its experts where they are)."""
    copies = sorted(((load[e] / counts[e], e) for e in range(len(counts)) for _ in range(counts[e])),
                    key=lambda copy: (-copy[0], copy[1]))
    held = [set(current[r * slots_per_rank:(r + 1) * slots_per_rank]) if current is not None else set()
            for r in range(num_ranks)]
    rank_load = [0.0] * num_ranks
    members: list[list[int]] = [[] for _ in range(num_ranks)]
    for share, expert in copies:
        open_ranks = [r for r in range(num_ranks) if len(members[r]) < slots_per_rank]
        # a second copy on a rank that has one already balances nothing: only when no other rank has room
        candidates = [r for r in open_ranks if expert not in members[r]] or open_ranks
        rank = min(candidates, key=lambda r: (rank_load[r], expert not in held[r], r))
        members[rank].append(expert)
        rank_load[rank] += share
    return members


def assign_slots(members: Sequence[Sequence[int]], slots_per_rank: int,
                 current: Sequence[int] | None = None) -> Placement:
    """The placement of ``members`` (each rank's experts): an expert a rank held in ``current``
    keeps that slot, the others take the free slots in id order."""
    placement: Placement = []
    for rank, experts in enumerate(members):
        before = current[rank * slots_per_rank:(rank + 1) * slots_per_rank] if current is not None else []
        slots = [-1] * slots_per_rank
        remaining = list(experts)
        for slot, expert in enumerate(before):
            if expert in remaining:
                slots[slot] = expert
                remaining.remove(expert)
        free = (slot for slot in range(slots_per_rank) if slots[slot] < 0)
        for expert in sorted(remaining):
            slots[next(free)] = expert
        placement.extend(slots)
    return placement


def balanced_placement(load: Sequence[float], num_ranks: int, slots_per_rank: int,
                       current: Sequence[int] | None = None) -> Placement:
    """A placement for ``load`` (tokens routed to each logical expert over the window): the
    hottest experts copied into the redundant slots, the copies packed so the ranks' loads are
    even, experts left where ``current`` has them where that costs no balance."""
    counts = replica_counts(load, num_ranks * slots_per_rank, max_copies=num_ranks)
    members = pack_copies(load, counts, num_ranks, slots_per_rank, current)
    return assign_slots(members, slots_per_rank, current)


def rank_loads(placement: Sequence[int], load: Sequence[float], num_ranks: int) -> list[float]:
    """Each rank's share of ``load`` under ``placement``: an expert's load split evenly over its copies."""
    copies = [0] * len(load)
    for expert in placement:
        copies[expert] += 1
    slots = len(placement) // num_ranks
    return [sum(load[e] / copies[e] for e in placement[r * slots:(r + 1) * slots]) for r in range(num_ranks)]


def rank_imbalance(placement: Sequence[int], load: Sequence[float], num_ranks: int) -> float:
    """The most loaded rank's load over the mean rank's (1.0: even; 0.0 with no load)."""
    loads = rank_loads(placement, load, num_ranks)
    total = sum(loads)
    return max(loads) * num_ranks / total if total else 0.0


@dataclasses.dataclass(frozen=True)
class ExpertMove:
    """Copy logical ``expert``'s weights from ``src_rank``'s slot ``src_slot`` (in the old placement)
    into ``dst_rank``'s slot ``dst_slot`` (slots are local to their rank)."""

    expert: int
    src_rank: int
    src_slot: int
    dst_rank: int
    dst_slot: int


def plan_moves(old: Sequence[int], new: Sequence[int], slots_per_rank: int) -> list[ExpertMove]:
    """The copies that turn placement ``old`` into ``new``: one for each slot whose expert changes,
    from the same rank where it held that expert already, else from the first rank that held it.
    Every rank derives the same list, so the sends and receives pair up."""
    moves = []
    for physical, expert in enumerate(new):
        if old[physical] == expert:
            continue
        dst_rank, dst_slot = divmod(physical, slots_per_rank)
        first_here = dst_rank * slots_per_rank
        here = [s for s in range(slots_per_rank) if old[first_here + s] == expert]
        src_rank, src_slot = (dst_rank, here[0]) if here else divmod(list(old).index(expert), slots_per_rank)
        moves.append(ExpertMove(expert, src_rank, src_slot, dst_rank, dst_slot))
    return moves
