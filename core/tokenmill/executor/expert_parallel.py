"""Whether ``enable_expert_parallel`` can place a model's experts: checked before any worker starts."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

# how the MoE families' configs count their routed experts (Mixtral, Qwen-MoE, DeepSeek)
EXPERT_COUNT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")


def routed_experts(hf_config: Any) -> int | None:
    """The number of routed experts a MoE layer of the model has (None: not a MoE config)."""
    for field in EXPERT_COUNT_FIELDS:
        value = getattr(hf_config, field, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_expert_parallel(hf_config: Any, tensor_parallel_size: int, enabled: bool) -> None:
    """Raise ``ValueError`` when the experts cannot be placed on the tensor-parallel ranks
    (fewer experts than ranks: a rank would hold none). Expert parallelism spans the
    tensor-parallel group, as in vLLM: with one rank, or on a model without experts, it is a
    no-op, said once in the log. An expert count the size does not divide is fine: the first
    ranks hold one expert more."""
    if not enabled:
        return
    experts = routed_experts(hf_config)
    if tensor_parallel_size == 1 or experts is None:
        why = "one tensor-parallel rank holds every expert" if experts is not None else "the model has no experts"
        logger.info("enable_expert_parallel has no effect: %s", why)
        return
    if experts < tensor_parallel_size:
        raise ValueError(f"enable_expert_parallel: the model's {experts} experts cannot be placed on "
                         f"tensor_parallel_size={tensor_parallel_size} ranks (each rank needs at least one)")
    base, extra = divmod(experts, tensor_parallel_size)
    share = f"{base} experts" if not extra else f"{base + 1} experts on the first {extra}, {base} on the others"
    logger.info("expert parallelism: %d experts a layer over %d ranks, %s", experts, tensor_parallel_size, share)
