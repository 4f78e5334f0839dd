"""ToyLM: a pre-norm rotary decoder written only against ``tokenmill.layers``.

Its weights use Llama's names, so a Llama checkpoint whose config says
``ToyLMForCausalLM`` loads into it unchanged; its layers are built with those
checkpoint names as their prefixes, though its own module names differ.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers import (
    Attention,
    Linear,
    ModelBuildContext,
    RMSNorm,
    VocabEmbedding,
    get_rotary_embedding,
    load_weight,
)


class ToyBlock(nn.Module):
    def __init__(self, config: Any, index: int, ctx: ModelBuildContext) -> None:
        super().__init__()
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_size = config.hidden_size // heads
        hidden = config.hidden_size
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        attn, mlp = ctx.child("self_attn"), ctx.child("mlp")
        self.q_proj = Linear(hidden, heads * self.head_size, ctx=attn.child("q_proj"))
        self.k_proj = Linear(hidden, kv_heads * self.head_size, ctx=attn.child("k_proj"))
        self.v_proj = Linear(hidden, kv_heads * self.head_size, ctx=attn.child("v_proj"))
        self.o_proj = Linear(heads * self.head_size, hidden, ctx=attn.child("o_proj"))
        self.gate_proj = Linear(hidden, config.intermediate_size, ctx=mlp.child("gate_proj"))
        self.up_proj = Linear(hidden, config.intermediate_size, ctx=mlp.child("up_proj"))
        self.down_proj = Linear(config.intermediate_size, hidden, ctx=mlp.child("down_proj"))
        self.rope = get_rotary_embedding(ctx, self.head_size, config.max_position_embeddings)
        self.attn = Attention(heads, self.head_size, kv_heads, self.head_size**-0.5, layer_index=index)
        self.heads, self.kv_heads = heads, kv_heads

    def forward(self, positions: torch.Tensor, x: torch.Tensor, metadata: Any) -> torch.Tensor:
        h = self.input_layernorm(x)
        n = h.shape[0]
        q = self.q_proj(h).view(n, self.heads, self.head_size)
        k = self.k_proj(h).view(n, self.kv_heads, self.head_size)
        q, k = self.rope(positions, q, k)
        x = x + self.o_proj(self.attn(q.reshape(n, -1), k.reshape(n, -1), self.v_proj(h), metadata))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class ToyLMForCausalLM(nn.Module):
    def __init__(self, config: Any, *, ctx: ModelBuildContext) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, ctx=ctx.child("model.embed_tokens"))
        self.blocks = nn.ModuleList(ToyBlock(config, i, ctx.child(f"model.layers.{i}"))
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, ctx=ctx.child("lm_head"))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: Any) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for block in self.blocks:
            x = block(positions, x, metadata)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            ours = (name.removeprefix("model.").replace("layers.", "blocks.")
                    .replace("self_attn.", "").replace("mlp.", ""))
            load_weight(params[ours], tensor)
            loaded.add(ours)
        return loaded
