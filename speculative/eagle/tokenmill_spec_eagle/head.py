"""The EAGLE-1 head as its checkpoints lay it out: ``fc`` maps the concatenation of a token's
embedding and the target's hidden state at the position before it (``2 * hidden`` wide) to
``hidden``; then Llama decoder layers (``layers.N.self_attn.{q,k,v,o}_proj``,
``layers.N.mlp.{gate,up,down}_proj``, ``layers.N.post_attention_layernorm``), the first
without an input norm (its input is ``fc``'s output, not a residual stream); no final norm.
Its output feeds the target's lm_head, and is the hidden state of the head's next step.

The head keeps a dense KV cache per request (``LayerKV``): it is one layer, small beside the
target. A call runs the tokens of several requests at once (``lengths`` of them each, in
order): the projections and the MLP over all of them, the attention request by request
against that request's cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers import RMSNorm, RotaryEmbedding


@dataclass
class LayerKV:
    """One layer's keys and values of one request, for the consecutive positions ``start ..``."""

    start: int
    keys: torch.Tensor  # [S, kv_heads, head_size]
    values: torch.Tensor

    @classmethod
    def empty(cls, start: int, attention: EagleAttention, device: torch.device, dtype: torch.dtype) -> LayerKV:
        """No positions yet, for ``attention``'s KV heads."""
        shape = (0, attention.num_kv_heads, attention.head_size)
        return cls(start, torch.empty(shape, device=device, dtype=dtype), torch.empty(shape, device=device, dtype=dtype))

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` positions (those of real, accepted tokens)."""
        self.keys, self.values = self.keys[:length], self.values[:length]


def head_size_of(config: Any) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


class EagleAttention(nn.Module):
    def __init__(self, config: Any, rotary: RotaryEmbedding, input_size: int | None = None) -> None:
        """``input_size``: the width q/k/v read (``hidden_size``; twice that in EAGLE-3)."""
        super().__init__()
        hidden, self.num_heads = config.hidden_size, config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_size = head_size_of(config)
        bias = bool(getattr(config, "attention_bias", False))
        width = input_size or hidden
        self.q_proj = nn.Linear(width, self.num_heads * self.head_size, bias=bias)
        self.k_proj = nn.Linear(width, self.num_kv_heads * self.head_size, bias=bias)
        self.v_proj = nn.Linear(width, self.num_kv_heads * self.head_size, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_size, hidden, bias=bias)
        self._rotary = [rotary]  # shared by the layers, kept out of the state dict

    def forward(self, positions: torch.Tensor, x: torch.Tensor, caches: Sequence[LayerKV],
                lengths: Sequence[int]) -> torch.Tensor:
        """Each request's new positions (after its cached ones) attend to its cache and
        themselves, causally; their keys and values join the cache."""
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_size)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_size)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_size)
        q, k = self._rotary[0](positions, q, k)
        out = torch.empty_like(q)
        first = 0
        for cache, length in zip(caches, lengths, strict=True):
            span = slice(first, first + length)
            cache.keys = torch.cat([cache.keys, k[span]])
            cache.values = torch.cat([cache.values, v[span]])
            out[span] = self._attend(q[span], positions[span], cache)
            first += length
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_size))

    def _attend(self, q: torch.Tensor, positions: torch.Tensor, cache: LayerKV) -> torch.Tensor:
        key_positions = cache.start + torch.arange(cache.keys.shape[0], device=q.device)
        allowed = key_positions[None, :] <= positions[:, None]
        groups = self.num_heads // self.num_kv_heads
        keys = cache.keys.transpose(0, 1).repeat_interleave(groups, dim=0)
        values = cache.values.transpose(0, 1).repeat_interleave(groups, dim=0)
        return F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=allowed).transpose(0, 1)


class EagleMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class EagleDecoderLayer(nn.Module):
    def __init__(self, config: Any, rotary: RotaryEmbedding, first: bool) -> None:
        super().__init__()
        self.input_layernorm: nn.Module = nn.Identity() if first else RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = EagleAttention(config, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = EagleMLP(config)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, caches: Sequence[LayerKV],
                lengths: Sequence[int]) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), caches, lengths)
        return x + self.mlp(self.post_attention_layernorm(x))


class EagleHead(nn.Module):
    def __init__(self, config: Any, max_position: int, fc_bias: bool) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.config = config
        self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
        self.rotary = RotaryEmbedding(config, head_size_of(config), max_position)
        self.layers = nn.ModuleList(EagleDecoderLayer(config, self.rotary, first=i == 0)
                                    for i in range(config.num_hidden_layers))

    def empty_caches(self, start: int, device: torch.device, dtype: torch.dtype) -> list[LayerKV]:
        """One request's caches (one per layer), starting at position ``start``."""
        return [LayerKV.empty(start, cast(EagleDecoderLayer, layer).self_attn, device, dtype) for layer in self.layers]

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                caches: Sequence[Sequence[LayerKV]], lengths: Sequence[int]) -> torch.Tensor:
        """The head's hidden states at ``positions``, from the embeddings of the tokens there
        plus one and the hidden states that predicted them; ``caches[r]`` (per layer) and
        ``lengths[r]`` are request ``r``'s, whose tokens come in that order. Appends to the caches."""
        x = self.fc(torch.cat([embeds, hidden], dim=-1))
        for index, layer in enumerate(self.layers):
            x = layer(positions, x, [request_caches[index] for request_caches in caches], lengths)
        return x
