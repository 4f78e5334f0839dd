"""The process groups one rank's model runs its collectives over.

Ranks are laid out stage-major: global rank ``stage * tensor_parallel_size + tp_rank``. The
ranks of one stage form a tensor-parallel group (all-reduce, all-gather); the ranks with one
``tp_rank`` across the stages form a pipeline group (hidden states sent stage to stage). With
one stage the tensor-parallel group is the default group, as it was before pipelines existed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist

from tokenmill.layers.communicator import SINGLE_RANK, Communicator
from tokenmill.layers.pipeline import SINGLE_STAGE, PipelineStage
from tokenmill.platform import platform_communicator
from tokenmill.worker.spec import WorkerSpec

if TYPE_CHECKING:
    from tokenmill.platform import Platform


@dataclass(frozen=True)
class ParallelGroups:
    tensor: Communicator  # this rank's stage: the ranks its layers are split over
    stage: PipelineStage  # which stage it is, linked to the same tp rank of the others


def parallel_groups(spec: WorkerSpec, platform: Platform | None = None) -> ParallelGroups:
    """This rank's groups, from the default ``torch.distributed`` group that the executor
    initialised with every rank before building the worker (one rank needs none). Every rank
    creates every subgroup, in one order, as ``torch.distributed.new_group`` requires. The
    tensor-parallel group's communicator is the ``platform``'s where it brings one
    (``GroupCommunicator``: the CPU's shared memory); the pipeline's links stay torch.distributed."""
    tp, pp = spec.config.tensor_parallel_size, spec.config.pipeline_parallel_size
    if tp * pp == 1:
        return ParallelGroups(SINGLE_RANK, SINGLE_STAGE)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != tp * pp:
        raise RuntimeError(f"tensor_parallel_size={tp} x pipeline_parallel_size={pp}: worker rank {spec.rank} "
                           f"needs torch.distributed initialised with {tp * pp} ranks by its executor")
    stage, tp_rank = divmod(spec.rank, tp)
    if pp == 1:
        return ParallelGroups(platform_communicator(platform, spec.rank, tp), SINGLE_STAGE)
    tensor = SINGLE_RANK
    if tp > 1:
        groups = [dist.new_group([s * tp + r for r in range(tp)]) for s in range(pp)]
    pipeline_group = None  # with one rank per stage, the stages are the default group
    if tp > 1:
        pipeline_group = [dist.new_group([s * tp + r for s in range(pp)]) for r in range(tp)][tp_rank]
        # after every new_group (which all ranks call in one order): it may run collectives on its group
        tensor = platform_communicator(platform, tp_rank, tp, groups[stage])
    # As many sends under way as the engine keeps micro-batches in flight (one per stage)
    link = Communicator(stage, pp, pipeline_group, max_pending_sends=pp)
    return ParallelGroups(tensor, PipelineStage(stage, pp, link))
