"""The rotary grouped-query self-attention block of the Llama family and of most MoE models.

One merged q/k/v projection (column-parallel: each rank takes its query heads and their K/V
heads, or, with fewer K/V heads than ranks, one K/V head replicated on tp / kv ranks), an
optional per-head RMSNorm of q and k (Qwen3), rotary positions, the paged :class:`Attention`
and a row-parallel output projection. A model plugin with this layout uses it instead of
writing it again; one whose attention differs (MLA, soft-capped scores) builds its own from
the same parts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.layers.attention import Attention
from tokenmill.layers.build_context import ModelBuildContext
from tokenmill.layers.linear import Linear, MergedLinear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import get_rotary_embedding


def attention_head_size(config: Any) -> int:
    """``head_dim`` where the config gives it, else hidden size over query heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_window_of_layer(config: Any, layer_index: int) -> int | None:
    """The layer's sliding window, or None for full attention."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:  # transformers 5 says per layer whether it slides
        return window if layer_types[layer_index] == "sliding_attention" else None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return window


class RotarySelfAttention(nn.Module):
    """Built as ``RotarySelfAttention(hf_config, layer_index, ctx, qkv_bias, o_bias, qk_norm)``;
    its parameters are ``qkv_proj``, ``o_proj`` and, with ``qk_norm``, ``q_norm``/``k_norm``."""

    def __init__(self, config: Any, layer_index: int, ctx: ModelBuildContext, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool) -> None:
        super().__init__()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        tp = ctx.world_size
        kv_parts = min(total_kv_heads, tp)
        self.num_heads = total_heads // tp
        self.num_kv_heads = total_kv_heads // kv_parts
        self.head_size = attention_head_size(config)
        q_size, kv_size = total_heads * self.head_size, total_kv_heads * self.head_size
        self.qkv_proj = MergedLinear(config.hidden_size, [q_size, kv_size, kv_size], bias=qkv_bias,
                                     ctx=ctx.child("qkv_proj"), parallel="column", shard_parts=[tp, kv_parts, kv_parts])
        self.o_proj = Linear(q_size, config.hidden_size, bias=o_bias, ctx=ctx.child("o_proj"), parallel="row")
        self.q_norm = RMSNorm(self.head_size, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_size, config.rms_norm_eps) if qk_norm else None
        self.rotary_emb = get_rotary_embedding(ctx, self.head_size, config.max_position_embeddings)
        self.attn = Attention(self.num_heads, self.head_size, self.num_kv_heads, self.head_size**-0.5,
                              sliding_window_of_layer(config, layer_index), layer_index)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        tokens = hidden.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q = q.view(tokens, self.num_heads, self.head_size)
        k = k.view(tokens, self.num_kv_heads, self.head_size)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q.reshape(tokens, -1), k.reshape(tokens, -1), v, metadata))
