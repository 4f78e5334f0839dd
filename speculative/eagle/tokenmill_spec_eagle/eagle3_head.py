"""The EAGLE-3 head as its checkpoints lay it out (``yuhuili/EAGLE3-*``, SpecForge's):

- ``fc.weight`` ``[H, 3 * H_target]``: maps the concatenation of three target layers' hidden
  states (low, middle, high) at a position to one hidden state ``h``;
- ``midlayer.*``: one Llama decoder layer whose attention reads ``2 * H``: the token
  embedding normed by ``midlayer.input_layernorm`` beside ``h`` normed by
  ``midlayer.hidden_norm``; the residual stream starts at ``h`` (at the normed ``h`` where the
  config sets ``norm_before_residual``); then ``post_attention_layernorm`` and the MLP as in Llama;
- ``norm.weight``: the final norm, before the head's own ``lm_head.weight`` ``[V_draft, H]``;
- ``d2t`` ``[V_draft]``: draft token ``d`` is target token ``d + d2t[d]`` (``t2d``, a mask over
  the target vocabulary, says the same the other way; greedy drafting does not need it);
- ``embed_tokens.weight`` only in some heads: the others share the target's embedding.

The layer's output before the final norm is the hidden state of the head's next draft step
(in place of ``fc``'s output: the target's layers are not there for drafts). The KV cache is
:class:`~tokenmill_spec_eagle.head.LayerKV`, one per request, as for EAGLE-1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from tokenmill.layers import RMSNorm, RotaryEmbedding
from tokenmill_spec_eagle.head import EagleAttention, EagleMLP, LayerKV, head_size_of


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, config: Any, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps)  # of the embeddings
        self.hidden_norm = RMSNorm(hidden, eps)  # of the hidden states
        self.self_attn = EagleAttention(config, rotary, input_size=2 * hidden)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = EagleMLP(config)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor,
                caches: Sequence[LayerKV], lengths: Sequence[int]) -> torch.Tensor:
        """The residual stream after the layer (the final norm not applied)."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        attention_input = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        residual = residual + self.self_attn(positions, attention_input, caches, lengths)
        return residual + self.mlp(self.post_attention_layernorm(residual))


class Eagle3Head(nn.Module):
    d2t: torch.Tensor

    def __init__(self, config: Any, fc_input_size: int, draft_vocab_size: int, max_position: int,
                 own_embedding: bool) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.fc = nn.Linear(fc_input_size, hidden, bias=False)
        self.rotary = RotaryEmbedding(config, head_size_of(config), max_position)
        self.midlayer = Eagle3DecoderLayer(config, self.rotary)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden) if own_embedding else None

    def empty_caches(self, start: int, device: torch.device, dtype: torch.dtype) -> list[LayerKV]:
        """One request's cache (its one layer's), starting at position ``start``."""
        return [LayerKV.empty(start, self.midlayer.self_attn, device, dtype)]

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                caches: Sequence[Sequence[LayerKV]], lengths: Sequence[int]) -> torch.Tensor:
        """The head's hidden states at ``positions`` (before the final norm), from the
        embeddings of the tokens there plus one and the hidden states that predicted them
        (``fc``'s output for the target's positions, the head's own for drafts); ``caches[r]``
        and ``lengths[r]`` are request ``r``'s, in order. Appends to the caches."""
        return self.midlayer(positions, embeds, hidden, [request_caches[0] for request_caches in caches], lengths)

    def draft_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The greedy draft of each row of ``hidden`` (the forward's output), as target token ids."""
        draft = self.lm_head(self.norm(hidden)).argmax(-1)
        return draft + self.d2t[draft]
