"""Whether a model splits over ``tensor_parallel_size`` ranks: checked before any worker starts."""

from __future__ import annotations

from typing import Any


def check_tensor_parallel(hf_config: Any, tensor_parallel_size: int) -> None:
    """Raise ``ValueError`` when the model's heads cannot be divided among the ranks.

    Query heads (and the MLP's intermediate size) must divide by the size. K/V heads are
    split when there are at least as many as ranks (they must then divide by the size) and
    replicated when there are fewer (the size must then divide by them, so each K/V head
    serves whole ranks). The vocabulary needs no check: its split pads the last rank.
    """
    tp = tensor_parallel_size
    if tp == 1:
        return
    heads = getattr(hf_config, "num_attention_heads", None)
    if heads is None:
        raise ValueError(f"tensor_parallel_size={tp}: the model's config has no num_attention_heads to split")
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {heads} attention heads")
    if kv_heads >= tp and kv_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {kv_heads} KV heads")
    if kv_heads < tp and tp % kv_heads:
        raise ValueError(f"tensor_parallel_size={tp} is not a multiple of the model's {kv_heads} KV heads, "
                         "so they cannot be replicated evenly over the ranks")
    intermediate = getattr(hf_config, "intermediate_size", None)
    if intermediate is not None and intermediate % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the model's intermediate size {intermediate}")
