"""A MoE layer's expert slots under expert-parallel load balancing, and routing to the copies.

With ``enable_eplb`` a layer of ``E`` logical experts has ``n * S`` physical slots over its ``n``
expert-parallel ranks, ``S`` a rank (:func:`tokenmill.eplb.config.slots_per_rank`); slot ``p``
holds logical expert ``physical_to_logical[p]`` and some experts hold several slots (the
redundant copies, :mod:`tokenmill.eplb.placement`). :class:`ReplicatedExperts` is a rank's view:
the layer's stacked weights have ``S`` rows, one a slot, and ``local_pairs`` turns the router's
logical top-k into the pairs this rank runs, as :class:`~tokenmill.layers.expert_parallel.ExpertPlacement`
does for one copy an expert.

Choosing a copy: every rank routes every token alike (the hidden states are the same on all of
them), and must pick the same copy for each token-expert pair, or a pair would run twice or
never. So the choice is a function of the step's top-k alone: the ``i``-th pair routed to an
expert in the step (in token order) goes to its copy ``i mod c``, so the ``c`` copies get equal
shares (within one) of the expert's tokens: each is the least loaded copy when its turn comes.
The result does not depend on the copy: every copy holds the same weights.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenmill.eplb.config import slots_per_rank
from tokenmill.eplb.placement import initial_placement


class ReplicatedExperts:
    """Rank ``rank``'s ``count`` slots of a layer's ``num_ranks * count`` physical experts.
    ``physical_to_logical`` may change while serving (:meth:`assign`, after the weights moved);
    the device tables that route to the copies are updated in place."""

    is_partial = True  # the layer runs its token-expert pairs through local_pairs

    def __init__(self, num_experts: int, rank: int, num_ranks: int, count: int, physical_to_logical: Sequence[int]):
        self.num_experts = num_experts
        self.rank = rank
        self.num_ranks = num_ranks
        self.count = count
        max_copies = num_ranks * count - num_experts + 1
        # logical expert -> its slots (-1 past its copies), and how many: created on the build's device
        self.logical_to_physical = torch.full((num_experts, max_copies), -1, dtype=torch.int64)
        self.replica_count = torch.zeros(num_experts, dtype=torch.int64)
        self.physical_to_logical: list[int] = []
        self.assign(physical_to_logical)

    @classmethod
    def for_rank(cls, num_experts: int, num_redundant: int, rank: int, num_ranks: int) -> ReplicatedExperts:
        """Rank ``rank``'s slots of the initial placement (``p mod E``: the first ranks hold the
        experts in order, the last slots copies of the first experts)."""
        count = slots_per_rank(num_experts, num_redundant, num_ranks)
        return cls(num_experts, rank, num_ranks, count, initial_placement(num_experts, num_ranks, count))

    def assign(self, physical_to_logical: Sequence[int]) -> None:
        """Route to the slots of ``physical_to_logical`` from now on (the weights are there already)."""
        if len(physical_to_logical) != self.num_ranks * self.count:
            raise ValueError(f"a placement of {len(physical_to_logical)} slots for {self.num_ranks} ranks of "
                             f"{self.count}")
        copies: list[list[int]] = [[] for _ in range(self.num_experts)]
        for physical, expert in enumerate(physical_to_logical):
            copies[expert].append(physical)
        if uncovered := [e for e, slots in enumerate(copies) if not slots]:
            raise ValueError(f"a placement without a copy of experts {uncovered}")
        table = torch.full(tuple(self.logical_to_physical.shape), -1, dtype=torch.int64)
        for expert, slots in enumerate(copies):
            table[expert, :len(slots)] = torch.tensor(slots)
        self.logical_to_physical.copy_(table)
        self.replica_count.copy_(torch.tensor([len(slots) for slots in copies]))
        self.physical_to_logical = list(physical_to_logical)

    @property
    def local_experts(self) -> list[int]:
        """The logical expert in each of this rank's slots."""
        return self.physical_to_logical[self.rank * self.count:(self.rank + 1) * self.count]

    def replicas(self) -> list[int]:
        """Copies of each logical expert over all ranks."""
        counts = [0] * self.num_experts
        for expert in self.physical_to_logical:
            counts[expert] += 1
        return counts

    def holds(self, expert: int) -> bool:
        return expert in self.local_experts

    def local_slots(self, expert: int) -> tuple[int, ...]:
        """This rank's slots holding ``expert`` (a checkpoint tensor loads into each)."""
        return tuple(slot for slot, held in enumerate(self.local_experts) if held == expert)

    def expert_at(self, slot: int) -> int:
        """The logical (global) id of the expert in local slot ``slot``, as errors name it."""
        return self.local_experts[slot]

    def physical_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Each pair of ``topk_ids`` (logical, any shape) mapped to one of its expert's slots, the
        ``i``-th pair of an expert to copy ``i mod copies``."""
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        per_expert = torch.bincount(flat, minlength=self.num_experts)
        first_of_expert = torch.cumsum(per_expert, 0) - per_expert
        nth = torch.empty_like(flat)
        nth[order] = torch.arange(flat.numel(), device=flat.device) - first_of_expert[flat[order]]
        copy = nth % self.replica_count[flat]
        return self.logical_to_physical[flat, copy].view_as(topk_ids)

    def local_pairs(self, topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The token-expert pairs of ``topk_ids`` ``[T, k]`` (logical ids) routed to this rank's
        copies: ``(token index, slot in its top-k, local slot)``, each ``[pairs]``."""
        local = self.physical_ids(topk_ids) - self.rank * self.count
        tokens, slots = torch.nonzero((local >= 0) & (local < self.count), as_tuple=True)
        return tokens, slots, local[tokens, slots]
