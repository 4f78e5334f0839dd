"""Loading a checkpoint's per-projection tensors into merged layers.

Checkpoints store q/k/v and gate/up as separate tensors (``...self_attn.q_proj.weight``);
models built from ``tokenmill.layers`` hold each group as one :class:`MergedLinear`
(``qkv_proj``, ``gate_up_proj``), so that one matmul computes them and tensor parallelism
splits each shard. This is the renaming and the shard index every such model needs.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from tokenmill.layers.linear import load_weight

# checkpoint projection name -> (merged parameter, shard index): the Llama layout
QKV_GATE_UP_SHARDS: Mapping[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def load_into_merged(params: Mapping[str, nn.Parameter], name: str, tensor: torch.Tensor,
                     shards: Mapping[str, tuple[str, int]] = QKV_GATE_UP_SHARDS, model_name: str = "the model") -> str:
    """Load checkpoint tensor ``name`` into its parameter (a shard of a merged one where
    ``shards`` names its projection); returns the parameter's name. A tensor with no
    parameter is a ``KeyError`` naming both, never silently dropped."""
    module_path, _, leaf = name.rpartition(".")
    owner, _, projection = module_path.rpartition(".")
    shard: int | None = None
    if projection in shards:
        merged, shard = shards[projection]
        name = f"{owner}.{merged}.{leaf}"
    if name not in params:
        raise KeyError(f"checkpoint tensor {name!r} has no parameter in {model_name}")
    load_weight(params[name], tensor, shard)
    return name
