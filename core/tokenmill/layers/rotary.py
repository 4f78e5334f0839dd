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

A model whose layers differ in rope (Gemma 3: sliding and global layers, each with
its own base) keeps ``rope_parameters`` per layer type, as transformers does
(``{"sliding_attention": {...}, "full_attention": {...}}``); ``layer_type`` picks one.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.layers.build_context import ModelBuildContext
from tokenmill.layers.ops import layer_ops


def rope_parameters(hf_config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The rope parameters of ``hf_config`` (of its layers of ``layer_type``, when given)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    return (params.get(layer_type) or {}) if layer_type is not None else params


def rope_inverse_frequencies(hf_config: Any, head_size: int, layer_type: str | None = None,
                             **init_kwargs: Any) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_size/2], attention_scaling)`` for ``hf_config``'s rope (that of its
    ``layer_type`` layers, when given); ``init_kwargs`` go to transformers' initialiser."""
    params = rope_parameters(hf_config, layer_type)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if layer_type is not None:
            init_kwargs["layer_type"] = layer_type
        return ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), **init_kwargs)
    base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    inv_freq = 1.0 / (base ** (torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size))
    return inv_freq, 1.0


def rope_table(inv_freq: torch.Tensor, scaling: float, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` [max_position, head_size] for positions ``0 .. max_position - 1``, on the CPU."""
    with torch.device("cpu"):
        positions = torch.arange(max_position, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


class RotaryEmbedding(nn.Module):
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor

    def __init__(self, hf_config: Any, head_size: int, max_position: int, layer_type: str | None = None) -> None:
        super().__init__()
        # The table is computed on the CPU whatever device the model is being built
        # on (transformers' rope initialisers mix explicit-CPU and ambient tensors),
        # then placed on that device.
        with torch.device("cpu"):
            inv_freq, scaling = rope_inverse_frequencies(hf_config, head_size, layer_type)
        self.set_table(*rope_table(inv_freq, scaling, max_position))

    def set_table(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        target = torch.get_default_device()
        self.register_buffer("cos_cache", cos.to(target), persistent=False)
        self.register_buffer("sin_cache", sin.to(target), persistent=False)

    def rope_positions(self, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """The rows of the table that ``positions`` rotate by: the positions themselves,
        except for a rope whose table depends on the request's length (LongRoPE)."""
        return positions

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q`` [T, H, D] and ``k`` [T, H_kv, D], rotated at ``positions`` [T] (possibly in place)."""
        return layer_ops(q.device).rotary(positions, q, k, self.cos_cache, self.sin_cache)


def get_rotary_embedding(ctx: ModelBuildContext, head_size: int, max_position: int,
                         layer_type: str | None = None) -> RotaryEmbedding:
    """The model's one rotary table for ``head_size`` and ``max_position`` under
    ``ctx.hf_config``'s rope parameters (those of its ``layer_type`` layers, when given),
    built by the first layer that asks."""
    params = rope_parameters(ctx.hf_config, layer_type)
    key = ("rotary", head_size, max_position, json.dumps(params, sort_keys=True, default=str))
    if params.get("rope_type") == "longrope":
        from tokenmill.layers.longrope import LongRopeRotaryEmbedding

        return ctx.shared_module(key, lambda: LongRopeRotaryEmbedding(ctx.hf_config, head_size, max_position,
                                                                      layer_type))
    if "mrope_section" in params:  # Qwen2-VL's three position sections (tokenmill.layers.mrope)
        from tokenmill.layers.mrope import MRotaryEmbedding

        return ctx.shared_module(key, lambda: MRotaryEmbedding(ctx.hf_config, head_size, max_position, layer_type))
    return ctx.shared_module(key, lambda: RotaryEmbedding(ctx.hf_config, head_size, max_position, layer_type))
