"""GPT-NeoX (``GPTNeoXForCausalLM``: Pythia, GPT-NeoX-20B): rotary positions on part of each
head, and, with ``use_parallel_residual``, attention and MLP both reading the block's input
(``x + attn(ln1(x)) + mlp(ln2(x))``) instead of one after the other.

``query_key_value`` is fused per head: its ``3 * hidden`` output rows are, head by head, that
head's q, k and v (``[heads, 3, head_size]``), not all q rows then all k rows. At load they
are regrouped into the q, k and v shards of one merged layer, so that tensor parallelism
cuts each by heads. Only the first ``rotary_ndims = head_size * partial_rotary_factor``
(``rotary_pct`` in older configs) dimensions of q and k are rotated, with a table of that width.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tokenmill.layers import Attention, Linear, MergedLinear, ModelBuildContext, VocabEmbedding, get_rotary_embedding
from tokenmill.plugin_api import AttentionMetadata
from tokenmill_models_gpt.decoder import GeluMLP, Renamed, load_renamed, output_head

_IGNORED = ("attention.rotary_emb.inv_freq", "attention.bias", "attention.masked_bias")


def rotary_ndims(config: Any) -> int:
    head_size = config.hidden_size // config.num_attention_heads
    partial = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor")
    if partial is None:
        partial = getattr(config, "rotary_pct", 1.0)
    return int(head_size * partial)


class GPTNeoXAttention(nn.Module):
    def __init__(self, config: Any, layer_index: int, ctx: ModelBuildContext) -> None:
        super().__init__()
        hidden, tp = config.hidden_size, ctx.world_size
        self.num_heads = config.num_attention_heads // tp
        self.head_size = hidden // config.num_attention_heads
        self.rotary_ndims = rotary_ndims(config)
        bias = bool(getattr(config, "attention_bias", True))
        self.query_key_value = MergedLinear(hidden, [hidden] * 3, bias=bias, ctx=ctx.child("query_key_value"),
                                            parallel="column")
        self.dense = Linear(hidden, hidden, bias=bias, ctx=ctx.child("dense"), parallel="row")
        self.rotary_emb = get_rotary_embedding(ctx, self.rotary_ndims, config.max_position_embeddings)
        self.attn = Attention(self.num_heads, self.head_size, self.num_heads, self.head_size**-0.5, None, layer_index)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        tokens = hidden.shape[0]
        q, k, v = (x.view(tokens, self.num_heads, self.head_size)
                   for x in self.query_key_value.split(self.query_key_value(hidden)))
        q, k = self._rotate(positions, q, k)
        return self.dense(self.attn(q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1), metadata))

    def _rotate(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate the first ``rotary_ndims`` dimensions of each head; the rest pass through."""
        n = self.rotary_ndims
        if n == self.head_size:
            return self.rotary_emb(positions, q.contiguous(), k.contiguous())
        q_rot, k_rot = self.rotary_emb(positions, q[..., :n].contiguous(), k[..., :n].contiguous())
        return torch.cat((q_rot, q[..., n:]), dim=-1), torch.cat((k_rot, k[..., n:]), dim=-1)


class GPTNeoXLayer(nn.Module):
    def __init__(self, config: Any, layer_index: int, ctx: ModelBuildContext) -> None:
        super().__init__()
        eps, hidden = config.layer_norm_eps, config.hidden_size
        self.use_parallel_residual = bool(config.use_parallel_residual)
        self.input_layernorm = nn.LayerNorm(hidden, eps=eps)
        self.post_attention_layernorm = nn.LayerNorm(hidden, eps=eps)
        self.attention = GPTNeoXAttention(config, layer_index, ctx.child("attention"))
        self.mlp = GeluMLP(hidden, config.intermediate_size, config.hidden_act, ctx.child("mlp"),
                           ("dense_h_to_4h", "dense_4h_to_h"))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        attended = self.attention(positions, self.input_layernorm(hidden), metadata)
        if self.use_parallel_residual:
            return hidden + attended + self.mlp(self.post_attention_layernorm(hidden))
        hidden = hidden + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class GPTNeoXModel(nn.Module):
    """``gpt_neox.`` of the checkpoint."""

    def __init__(self, config: Any, ctx: ModelBuildContext) -> None:
        super().__init__()
        self.embed_in = VocabEmbedding(config.vocab_size, config.hidden_size, ctx=ctx.child("embed_in"), parallel=True)
        self.layers = nn.ModuleList(GPTNeoXLayer(config, i, ctx.child(f"layers.{i}"))
                                    for i in range(config.num_hidden_layers))
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_in(input_ids)
        for layer in self.layers:
            hidden = layer(positions, hidden, metadata)
        return self.final_layer_norm(hidden)


class GPTNeoXForCausalLM(nn.Module):
    """Built as ``GPTNeoXForCausalLM(hf_config, ctx=ctx)``; the checkpoint's names start at
    ``gpt_neox.`` and ``embed_out.`` (the output head, its own unless the config ties it)."""

    def __init__(self, config: Any, *, ctx: ModelBuildContext) -> None:
        super().__init__()
        self.config = config
        self.gpt_neox = GPTNeoXModel(config, ctx.child("gpt_neox"))
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.embed_out = output_head(config, self.gpt_neox.embed_in, ctx.child("embed_out"), tied=self.tied)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        return self.gpt_neox(input_ids, positions, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.embed_out(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_renamed(self, weights, self._rename)

    def _rename(self, name: str, tensor: torch.Tensor) -> Renamed:
        if name.endswith(_IGNORED) or (self.tied and name.startswith("embed_out.")):
            return
        if name.rpartition(".")[0].endswith("attention.query_key_value"):
            heads = self.config.num_attention_heads
            per_head = tensor.view(heads, 3, -1, *tensor.shape[1:])  # [heads, (q, k, v), head_size, (hidden)]
            for shard in range(3):
                yield name, per_head[:, shard].reshape(-1, *tensor.shape[1:]), shard
            return
        yield name, tensor, None
