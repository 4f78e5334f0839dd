"""GPT-2 (``GPT2LMHeadModel``): learned absolute position embeddings, pre-LayerNorm blocks,
fused q/k/v, and an lm_head tied to the token embedding.

Its checkpoint stores every projection as a ``Conv1D``: the weight is ``[in, out]``, the
transpose of a linear layer's ``[out, in]``. Each is transposed once at load; ``c_attn``'s
``[hidden, 3 * hidden]`` then splits into the q, k and v shards of one merged layer (in
that order, each ``hidden`` wide), so that tensor parallelism cuts each by heads.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tokenmill.layers import Attention, Linear, MergedLinear, ModelBuildContext, VocabEmbedding
from tokenmill.plugin_api import AttentionMetadata, UnsupportedModelError
from tokenmill_models_gpt.decoder import GeluMLP, Renamed, load_renamed, output_head

_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
# the causal-mask buffers older checkpoints saved with their weights
_BUFFERS = ("attn.bias", "attn.masked_bias")


class GPT2Attention(nn.Module):
    def __init__(self, config: Any, layer_index: int, ctx: ModelBuildContext) -> None:
        super().__init__()
        hidden, tp = config.hidden_size, ctx.world_size
        self.num_heads = config.num_attention_heads // tp
        self.head_size = hidden // config.num_attention_heads
        self.c_attn = MergedLinear(hidden, [hidden] * 3, bias=True, ctx=ctx.child("c_attn"), parallel="column")
        self.c_proj = Linear(hidden, hidden, bias=True, ctx=ctx.child("c_proj"), parallel="row")
        scale = self.head_size**-0.5 if config.scale_attn_weights else 1.0
        self.attn = Attention(self.num_heads, self.head_size, self.num_heads, scale, None, layer_index)

    def forward(self, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.c_attn.split(self.c_attn(hidden))
        return self.c_proj(self.attn(q, k, v, metadata))


class GPT2Block(nn.Module):
    def __init__(self, config: Any, layer_index: int, ctx: ModelBuildContext) -> None:
        super().__init__()
        eps, hidden = config.layer_norm_epsilon, config.hidden_size
        self.ln_1 = nn.LayerNorm(hidden, eps=eps)
        self.attn = GPT2Attention(config, layer_index, ctx.child("attn"))
        self.ln_2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = GeluMLP(hidden, config.n_inner or 4 * hidden, config.activation_function, ctx.child("mlp"),
                           ("c_fc", "c_proj"))

    def forward(self, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        hidden = hidden + self.attn(self.ln_1(hidden), metadata)
        return hidden + self.mlp(self.ln_2(hidden))


class GPT2Model(nn.Module):
    """``transformer.`` of the checkpoint."""

    def __init__(self, config: Any, ctx: ModelBuildContext) -> None:
        super().__init__()
        self.wte = VocabEmbedding(config.vocab_size, config.hidden_size, ctx=ctx.child("wte"), parallel=True)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config, i, ctx.child(f"h.{i}")) for i in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        hidden = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            hidden = block(hidden, metadata)
        return self.ln_f(hidden)


class GPT2LMHeadModel(nn.Module):
    """Built as ``GPT2LMHeadModel(hf_config, ctx=ctx)``; the checkpoint's names start at
    ``transformer.`` (and ``lm_head.``, which is the tied embedding and is not loaded)."""

    def __init__(self, config: Any, *, ctx: ModelBuildContext) -> None:
        super().__init__()
        for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
            if getattr(config, flag, False):
                raise UnsupportedModelError(f"GPT-2 with {flag}=True is not supported")
        self.config = config
        self.transformer = GPT2Model(config, ctx.child("transformer"))
        self.tied = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = output_head(config, self.transformer.wte, ctx.child("lm_head"), tied=self.tied)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        return self.transformer(input_ids, positions, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_renamed(self, weights, self._rename)

    def _rename(self, name: str, tensor: torch.Tensor) -> Renamed:
        if name.startswith("lm_head.") and self.tied:
            return
        if not name.startswith(("transformer.", "lm_head.")):
            name = f"transformer.{name}"  # a bare GPT2Model checkpoint
        module = name.rpartition(".")[0]
        if module.endswith(_BUFFERS):
            return
        if name.endswith(".weight") and module.endswith(_CONV1D):
            tensor = tensor.t()
        if module.endswith("attn.c_attn"):
            for shard, part in enumerate(tensor.chunk(3, dim=0)):
                yield name, part, shard
            return
        yield name, tensor, None
