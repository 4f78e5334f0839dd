"""The worker side of expert-parallel load balancing: measure the load, move experts every N steps.

Each worker of the expert-parallel (tensor-parallel) group keeps an :class:`ExpertRebalancer`.
Before each step that computes tokens within ``window_size`` steps of the next rebalance it records
the MoE layers' ``expert_load`` counters (one small stacked copy on the device, no sync), keeping
the last ``window_size + 1`` records, so the difference of the newest and the oldest is the load of
the last ``window_size`` steps. Every
``step_interval`` such steps it rebalances, before that step's forward:

1. the window's load is broadcast from rank 0 (the ranks count alike, as every rank routes every
   token; the broadcast makes sure they decide alike even so);
2. each layer's new placement is :func:`~tokenmill.eplb.placement.balanced_placement` of that
   load, kept only where it spreads the load over the ranks more evenly than the current one
   (an unchanged load moves nothing);
3. :func:`move_expert_weights` copies each slot's new expert in from the rank holding it
   (``torch.distributed`` point-to-point over the group: gloo on the CPU) or from another slot of
   its own rank, then the layer routes to the new slots.

All of it happens inside one ``execute_model`` call, between two forwards: the scheduler, its
requests and their KV cache are untouched, so serving goes on and no request is dropped; the step
that rebalances takes longer by the moves. Every rank takes the same steps (the executor sends
each step to all), so they reach the rebalance together.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from tokenmill.eplb.config import EPLBConfig
from tokenmill.eplb.placement import balanced_placement, plan_moves, rank_imbalance
from tokenmill.layers.communicator import Communicator
from tokenmill.layers.expert_replicas import ReplicatedExperts
from tokenmill.layers.moe import FusedMoE

logger = logging.getLogger(__name__)

# A layer's tensors sized by its logical experts, not its slots: they never move.
_LOGICAL_TENSORS = frozenset({"expert_load", "e_score_correction_bias"})
# A new placement must beat the current one's max/mean rank load by this much to be worth its moves.
_MIN_GAIN = 1e-6


def balanced_layers(model: nn.Module) -> list[FusedMoE]:
    """The MoE layers of ``model`` whose experts the balancer places."""
    return [m for m in model.modules() if isinstance(m, FusedMoE) and isinstance(m.placement, ReplicatedExperts)]


def replicas_by_layer(model: nn.Module) -> dict[str, list[int]]:
    """Copies of each logical expert, per balanced MoE layer of ``model`` (by checkpoint prefix)."""
    return {layer.prefix: cast(ReplicatedExperts, layer.placement).replicas() for layer in balanced_layers(model)}


def expert_slot_tensors(layer: FusedMoE) -> list[torch.Tensor]:
    """The layer's tensors with one row a slot (weights, a quantized method's scales ...), in
    registration order (the same on every rank)."""
    named = [*layer.named_parameters(recurse=False), *layer.named_buffers(recurse=False)]
    return [t.data for name, t in named
            if name not in _LOGICAL_TENSORS and t.dim() > 0 and t.shape[0] == layer.num_local_experts]


class ExpertRebalancer:
    """One rank's load window and rebalance schedule over ``model``'s balanced MoE layers."""

    def __init__(self, model: nn.Module, comm: Communicator, config: EPLBConfig) -> None:
        self.layers = balanced_layers(model)
        self.comm = comm
        self.config = config
        self.window: deque[torch.Tensor] = deque(maxlen=config.window_size + 1)
        self.steps = 0
        self.rebalances = 0  # rebalances that changed a layer's placement
        self.experts_moved = 0  # slots that took a new expert's weights, on all ranks

    def before_step(self, num_scheduled_tokens: int) -> None:
        """Record the load so far, and rebalance if this is the step to (call it before the
        forward of every step, with the tokens it computes: an empty step is not counted)."""
        if not self.layers or num_scheduled_tokens == 0:
            return
        self.steps += 1
        if self._snapshot_needed():
            self.window.append(torch.stack([cast(torch.Tensor, layer.expert_load) for layer in self.layers]))
        if self.steps % self.config.step_interval == 0 and len(self.window) > 1:
            self.rebalance()

    def _snapshot_needed(self) -> bool:
        """Whether this step's counters can be an end of a coming rebalance's window: only the
        last ``window_size + 1`` steps up to each rebalance are (the window's first and last are
        read), so a long interval keeps no snapshots of the steps between windows."""
        window, interval = self.config.window_size, self.config.step_interval
        return window >= interval or (-self.steps) % interval <= window

    def window_load(self) -> list[list[int]]:
        """Tokens routed to each logical expert of each layer over the window, rank 0's counts."""
        load = self.comm.broadcast(self.window[-1] - self.window[0], src=0)
        return cast(list[list[int]], load.tolist())

    @torch.no_grad()
    def rebalance(self) -> None:
        """A new placement for every layer whose load it spreads better, its weights moved in."""
        moved = 0
        for layer, load in zip(self.layers, self.window_load(), strict=True):
            placement = cast(ReplicatedExperts, layer.placement)
            current = placement.physical_to_logical
            proposal = balanced_placement(load, placement.num_ranks, placement.count, current)
            ranks = placement.num_ranks
            before, after = rank_imbalance(current, load, ranks), rank_imbalance(proposal, load, ranks)
            if after >= before - _MIN_GAIN:
                continue
            moved += move_expert_weights(layer, proposal, self.comm)
            placement.assign(proposal)
            logger.debug("%s: experts rebalanced, rank max/mean load %.3f -> %.3f", layer.prefix, before, after)
        if moved:
            self.rebalances += 1
            self.experts_moved += moved
            logger.info("expert-parallel load balancing: %d expert slots moved (rebalance %d, step %d)", moved,
                        self.rebalances, self.steps)

    def stats(self) -> dict[str, Any]:
        """What the balancer did, and each layer's placement now (a worker answers it by rpc)."""
        return {"steps": self.steps, "rebalances": self.rebalances, "experts_moved": self.experts_moved,
                "placements": {layer.prefix: list(cast(ReplicatedExperts, layer.placement).physical_to_logical)
                               for layer in self.layers}}


def move_expert_weights(layer: FusedMoE, new: list[int], comm: Communicator) -> int:
    """Fill ``layer``'s slots with the experts of placement ``new`` (its placement still the old
    one): every rank runs this with the same arguments. Returns the slots changed on all ranks."""
    placement = cast(ReplicatedExperts, layer.placement)
    moves = plan_moves(placement.physical_to_logical, new, placement.count)
    rank, tensors = comm.rank, expert_slot_tensors(layer)
    # the old rows that are sent or copied, saved first: a slot may be a source and a destination
    saved = {move.src_slot: [t[move.src_slot].clone() for t in tensors] for move in moves if move.src_rank == rank}
    incoming: dict[int, list[torch.Tensor]] = {}
    pending: list[Any] = []
    for index, move in enumerate(moves):  # every rank walks the same list: sends and receives pair up by tag
        tags = range(index * len(tensors), (index + 1) * len(tensors))
        if move.src_rank == rank and move.dst_rank != rank:
            for tag, row in zip(tags, saved[move.src_slot], strict=True):
                pending.append(dist.isend(row, comm.global_rank(move.dst_rank), group=comm.group, tag=tag))
        elif move.dst_rank == rank and move.src_rank != rank:
            rows = incoming[move.dst_slot] = [torch.empty_like(t[move.dst_slot]) for t in tensors]
            for tag, row in zip(tags, rows, strict=True):
                pending.append(dist.irecv(row, comm.global_rank(move.src_rank), group=comm.group, tag=tag))
    for work in pending:
        if work is not None:
            work.wait()
    for move in moves:
        if move.dst_rank == rank:
            rows = saved[move.src_slot] if move.src_rank == rank else incoming[move.dst_slot]
            for tensor, row in zip(tensors, rows, strict=True):
                tensor[move.dst_slot].copy_(row)
    return len(moves)


def expert_rebalancer(config: Any, model: nn.Module, comm: Communicator) -> ExpertRebalancer | None:
    """A worker's balancer, where ``config`` (the ``EngineConfig``) enables one and the model has
    layers to balance."""
    if not config.enable_eplb or not balanced_layers(model):
        return None
    return ExpertRebalancer(model, comm, config.eplb_config)
