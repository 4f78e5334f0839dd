"""Expert parallelism: which rank holds which experts of a MoE layer, and running a rank's share.

With ``enable_expert_parallel`` the tensor-parallel group places *whole* experts on ranks
instead of splitting every expert's intermediate dimension: rank ``r`` of ``n`` holds a
contiguous run of ``E // n`` experts, one more for the first ``E % n`` ranks (8 experts over
3 ranks: 0-2, 3-5, 6-7), so an expert count that does not divide still places every expert
exactly once.

Dispatch and combine ride on what tensor parallelism already has: the hidden states entering a
MoE layer are the same on every rank of the group (the attention block's row-parallel output
was all-reduced), so every rank routes every token (the same top-k: routing is not split),
runs the token-expert pairs whose expert it holds, and the ranks' partial outputs are summed by
the all-reduce that an intermediate-split layer needs anyway. That is one all-reduce of
``[tokens, hidden]`` per MoE layer, as without expert parallelism; an all-to-all dispatch
(which gloo does run) would pay off only where each rank starts with different tokens (data
parallelism), and would otherwise add a gather back to every rank.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class ExpertPlacement:
    """This rank's experts of a layer of ``num_experts``: global ids ``[first, first + count)``."""

    num_experts: int
    first: int = 0
    count: int = -1  # -1: every expert (set in __post_init__)

    def __post_init__(self) -> None:
        if self.count < 0:
            object.__setattr__(self, "count", self.num_experts - self.first)

    @classmethod
    def for_rank(cls, num_experts: int, rank: int, size: int) -> ExpertPlacement:
        """Rank ``rank``'s contiguous share of ``num_experts`` over ``size`` ranks."""
        if num_experts < size:
            raise ValueError(f"expert parallelism over {size} ranks needs at least {size} experts, not {num_experts}")
        base, extra = divmod(num_experts, size)
        return cls(num_experts, rank * base + min(rank, extra), base + (1 if rank < extra else 0))

    @property
    def is_partial(self) -> bool:
        """Whether other ranks hold some of the experts."""
        return self.count < self.num_experts

    def holds(self, expert: int) -> bool:
        return self.first <= expert < self.first + self.count

    def local_pairs(self, topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The token-expert pairs of ``topk_ids`` ``[T, k]`` (global ids) whose expert this rank
        holds: ``(token index, slot in its top-k, local expert id)``, each ``[pairs]``."""
        local = topk_ids - self.first
        tokens, slots = torch.nonzero((local >= 0) & (local < self.count), as_tuple=True)
        return tokens, slots, local[tokens, slots]

    def local_slots(self, expert: int) -> tuple[int, ...]:
        """Where in this rank's stack expert ``expert`` is (none: another rank's)."""
        return (expert - self.first,) if self.holds(expert) else ()

    def expert_at(self, slot: int) -> int:
        """The global id of the expert at index ``slot`` of this rank's stack, as errors name it."""
        return self.first + slot
