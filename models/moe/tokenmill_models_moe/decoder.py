"""The decoder MoE families share: an attention block (Llama-style by default, DeepSeek's
latent attention in :mod:`.mla`), then a sparse MoE block (or, in the layers a config
leaves dense, a plain SiLU MLP).

The attention is the Llama family's (q/k/v merged into one column-parallel matmul,
o_proj row-parallel, optional q/k bias and per-head q/k RMSNorm), rebuilt here from
``tokenmill.layers`` because a plugin imports only the public surface, never another
plugin's package. The MoE block is the router (a replicated float linear layer, as
checkpoints keep it unquantized), :class:`tokenmill.layers.FusedMoE` and, for
Qwen2-MoE, a shared expert scaled by the sigmoid of its own one-output gate (DeepSeek's
shared experts are added ungated).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers import (
    AuxHiddenStateRecorder,
    FusedMoE,
    Linear,
    MergedLinear,
    ModelBuildContext,
    MoERouting,
    RMSNorm,
    RotarySelfAttention,
    UnquantizedLinearMethod,
    VocabEmbedding,
    layer_ops,
)
from tokenmill.plugin_api import AttentionMetadata


@dataclasses.dataclass(frozen=True)
class MoEShape:
    """What a family's config says about its MoE layers, in one place."""

    module_name: str  # the block's checkpoint name: "block_sparse_moe" (Mixtral), "mlp" (Qwen)
    num_experts: int
    intermediate_size: int  # of one expert
    routing: MoERouting
    expert_names: tuple[str, str, str]  # the checkpoint's (gate, up, down) names of an expert
    shared_intermediate_size: int = 0  # 0: no shared expert
    sparse_layers: frozenset[int] = frozenset()  # the layers with experts; the others are dense
    shared_expert_name: str = "shared_expert"  # the checkpoint's: "shared_expert" (Qwen), "shared_experts" (DeepSeek)
    shared_expert_gated: bool = True  # scaled by the sigmoid of a one-output gate (Qwen2-MoE)


# builds a layer's attention block: (config, layer_index, ctx) -> module(positions, hidden, metadata)
AttentionFactory = Callable[[Any, int, ModelBuildContext], nn.Module]


def _check_silu(config: Any) -> None:
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported MoE activation: hidden_act={config.hidden_act!r} (supported: 'silu')")


# The Llama-layout attention most MoE models share (Mixtral, Qwen2-MoE, Qwen3-MoE).
MoEAttention = RotarySelfAttention


class DenseMLP(nn.Module):
    """A SiLU-gated MLP: the dense layers' MLP and Qwen2-MoE's shared expert."""

    def __init__(self, hidden_size: int, intermediate_size: int, ctx: ModelBuildContext) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size] * 2, ctx=ctx.child("gate_up_proj"),
                                         parallel="column")
        self.down_proj = Linear(intermediate_size, hidden_size, ctx=ctx.child("down_proj"), parallel="row")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        return self.down_proj(layer_ops(gate_up.device).silu_and_mul(gate_up))


class SparseMoEBlock(nn.Module):
    def __init__(self, config: Any, shape: MoEShape, ctx: ModelBuildContext) -> None:
        super().__init__()
        self.gate = Linear(config.hidden_size, shape.num_experts, ctx=ctx.child("gate"),
                           quant_method=UnquantizedLinearMethod())
        self.experts = FusedMoE(shape.num_experts, config.hidden_size, shape.intermediate_size, shape.routing,
                                ctx=ctx.child("experts"), expert_names=shape.expert_names)
        # the shared expert is registered under the checkpoint's name for it
        self.shared_name = shape.shared_expert_name if shape.shared_intermediate_size else None
        self.shared_expert_gate: Linear | None = None
        if self.shared_name is not None:
            self.add_module(self.shared_name, DenseMLP(config.hidden_size, shape.shared_intermediate_size,
                                                       ctx.child(self.shared_name)))
            if shape.shared_expert_gated:
                self.shared_expert_gate = Linear(config.hidden_size, 1, ctx=ctx.child("shared_expert_gate"),
                                                 quant_method=UnquantizedLinearMethod())

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden, self.gate(hidden))
        if self.shared_name is None:
            return out
        shared = getattr(self, self.shared_name)(hidden)
        if self.shared_expert_gate is not None:
            shared = F.sigmoid(self.shared_expert_gate(hidden)) * shared
        return out + shared


class MoEDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_index: int, ctx: ModelBuildContext, shape: MoEShape,
                 attention: AttentionFactory) -> None:
        super().__init__()
        self.self_attn = attention(config, layer_index, ctx.child("self_attn"))
        sparse = layer_index in shape.sparse_layers
        # named as the checkpoint names the block: ``block_sparse_moe`` (Mixtral) or ``mlp``
        self.mlp_name = shape.module_name if sparse else "mlp"
        mlp_ctx = ctx.child(self.mlp_name)
        block = SparseMoEBlock(config, shape, mlp_ctx) if sparse else DenseMLP(
            config.hidden_size, config.intermediate_size, mlp_ctx)
        self.add_module(self.mlp_name, block)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm residual block, the residual carried separately (as in the Llama family)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(positions, hidden, metadata)
        hidden = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return getattr(self, self.mlp_name)(hidden), residual


class MoEModel(nn.Module):
    def __init__(self, config: Any, ctx: ModelBuildContext, shape: MoEShape, attention: AttentionFactory) -> None:
        super().__init__()
        _check_silu(config)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, ctx=ctx.child("embed_tokens"),
                                           parallel=True)
        self.layers = nn.ModuleList(MoEDecoderLayer(config, i, ctx.child(f"layers.{i}"), shape, attention)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.aux_hidden_states = AuxHiddenStateRecorder(config.num_hidden_layers)  # for EAGLE-3

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for index, layer in enumerate(self.layers):
            self.aux_hidden_states.before_layer(index, hidden, residual)
            hidden, residual = layer(positions, hidden, residual, metadata)
        self.aux_hidden_states.before_norm(hidden, residual)
        if residual is None:
            return self.norm(hidden)
        return self.norm.add_and_norm(hidden, residual)
