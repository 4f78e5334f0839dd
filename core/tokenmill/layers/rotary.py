"""Rotary position embedding with a precomputed cos/sin table.

Inverse frequencies come from transformers' own rope initialisers, so every
rope type its configs use (default, linear, dynamic, llama3, yarn, ...) means
exactly what it means there. ``dynamic`` is evaluated once at the configured
maximum length instead of per forward: identical below the original
context length.

The table depends only on the head size, the maximum position and the rope
parameters, so the layers of one model share one (:func:`get_rotary_embedding`)
instead of each holding a copy (30 copies of 4 MiB in SmolLM2-135M). It stays
float32 whatever the model's dtype: transformers computes cos and sin in float32
and casts them to the activations' dtype only where it applies them, and the CPU
platform's rotary kernel reads float32 tables.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

from tokenmill.layers.build_context import ModelBuildContext
from tokenmill.layers.ops import layer_ops


def rope_inverse_frequencies(hf_config: Any, head_size: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_size/2], attention_scaling)`` for ``hf_config``'s rope."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        return ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    inv_freq = 1.0 / (base ** (torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size))
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor

    def __init__(self, hf_config: Any, head_size: int, max_position: int) -> None:
        super().__init__()
        # The table is computed on the CPU whatever device the model is being built
        # on (transformers' rope initialisers mix explicit-CPU and ambient tensors),
        # then placed on that device.
        target = torch.get_default_device()
        with torch.device("cpu"):
            inv_freq, scaling = rope_inverse_frequencies(hf_config, head_size)
            positions = torch.arange(max_position, dtype=torch.int64).float()
            freqs = positions[:, None] * inv_freq.float()[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", (emb.cos() * scaling).to(target), persistent=False)
        self.register_buffer("sin_cache", (emb.sin() * scaling).to(target), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q`` [T, H, D] and ``k`` [T, H_kv, D], rotated at ``positions`` [T] (possibly in place)."""
        return layer_ops(q.device).rotary(positions, q, k, self.cos_cache, self.sin_cache)


def get_rotary_embedding(ctx: ModelBuildContext, head_size: int, max_position: int) -> RotaryEmbedding:
    """The model's one rotary table for ``head_size`` and ``max_position`` under
    ``ctx.hf_config``'s rope parameters, built by the first layer that asks."""
    params = getattr(ctx.hf_config, "rope_parameters", None) or {}
    key = ("rotary", head_size, max_position, json.dumps(params, sort_keys=True, default=str))
    return ctx.shared_module(key, lambda: RotaryEmbedding(ctx.hf_config, head_size, max_position))
