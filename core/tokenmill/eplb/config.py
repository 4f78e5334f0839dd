"""``eplb_config``: how many redundant experts, and how often the placement follows the load (vLLM's names)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class EPLBConfig(BaseModel):
    """The expert-parallel load balancer's options; they take effect with ``enable_eplb``."""

    model_config = ConfigDict(extra="forbid")

    num_redundant_experts: int = Field(
        default=0, ge=0, description="Extra expert slots a MoE layer gets over all ranks, filled with copies of the "
                                     "most loaded experts; (experts + redundant) must divide over the ranks")
    window_size: int = Field(default=1000, gt=0, description="Steps the expert load is measured over")
    step_interval: int = Field(
        default=3000, gt=0, description="Steps between two rebalances (each one uses the load of the last "
                                        "window_size steps)")


def check_eplb_options(enable_eplb: bool, enable_expert_parallel: bool, eplb: EPLBConfig) -> None:
    """The model-independent rules, checked when the engine config is built: the balancer moves
    whole experts between expert-parallel ranks, so it needs expert parallelism, and redundant
    experts need the balancer."""
    if enable_eplb and not enable_expert_parallel:
        raise ValueError("enable_eplb balances experts over expert-parallel ranks: it needs enable_expert_parallel")
    if eplb.num_redundant_experts and not enable_eplb:
        raise ValueError(f"eplb_config.num_redundant_experts={eplb.num_redundant_experts} needs enable_eplb "
                         "(and enable_expert_parallel): redundant experts are the load balancer's copies")


def slots_per_rank(num_experts: int, num_redundant: int, num_ranks: int) -> int:
    """Physical experts each rank holds: ``(experts + redundant) / ranks``; ``ValueError`` when that
    does not divide, or when a rank would need more slots than there are experts (a second copy of
    one expert on one rank balances nothing)."""
    physical = num_experts + num_redundant
    if physical % num_ranks:
        lower = num_redundant - physical % num_ranks
        fits = f"{lower} or {lower + num_ranks}" if lower >= 0 else f"{lower + num_ranks}"
        raise ValueError(f"eplb_config.num_redundant_experts={num_redundant}: {num_experts} experts + {num_redundant} "
                         f"redundant = {physical} physical experts do not divide over {num_ranks} expert-parallel "
                         f"ranks (try {fits})")
    per_rank = physical // num_ranks
    if per_rank > num_experts:
        raise ValueError(f"eplb_config.num_redundant_experts={num_redundant} is more than the slots allow: "
                         f"{num_ranks} ranks of {per_rank} slots would each hold more than the model's {num_experts} "
                         f"experts; at most {num_experts * (num_ranks - 1)} redundant experts (every expert on "
                         "every rank)")
    return per_rank


def check_eplb(hf_config: Any, tensor_parallel_size: int, enable_eplb: bool, eplb: EPLBConfig) -> None:
    """The rules that need the model, checked before any worker starts: experts to balance, more
    than one rank to balance them over, and a redundant count the slots allow."""
    if not enable_eplb:
        return
    from tokenmill.executor.expert_parallel import routed_experts

    experts = routed_experts(hf_config)
    if experts is None:
        raise ValueError("enable_eplb: the model has no experts to balance")
    if tensor_parallel_size == 1:
        raise ValueError("enable_eplb: expert parallelism over tensor_parallel_size=1 rank leaves no other rank to "
                         "place expert copies on")
    slots_per_rank(experts, eplb.num_redundant_experts, tensor_parallel_size)
