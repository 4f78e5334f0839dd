"""DeepSeek's multi-head latent attention (MLA), over the engine's ordinary paged KV cache.

Keys and values come from one small latent per token: ``kv_a_proj_with_mqa`` projects
the hidden state to ``kv_lora_rank`` latent features plus ``qk_rope_head_dim`` rotary
features shared by all heads; the latent is RMS-normed (``kv_a_layernorm``) and
``kv_b_proj`` expands it into every head's non-rotary key part (``qk_nope_head_dim``)
and its value (``v_head_dim``). A head's key is its non-rotary part followed by the
shared rotary part; its query likewise (through ``q_a_proj`` / ``q_a_layernorm`` /
``q_b_proj`` when the config has a ``q_lora_rank``, else one ``q_proj``).

The KV cache (a first version): what is cached is the *decompressed* per-head key and
value, through the same :class:`tokenmill.layers.Attention` layer and paged layout every
other model uses, so every attention backend, chunked prefill and the prefix cache work
unchanged. A head's key and value have different sizes, and the paged layout holds one
head size, so the shorter of the two is padded with zeros to the longer (zero features
change no score and are cut from the output). Caching the compressed latent instead
(``kv_lora_rank + qk_rope_head_dim`` numbers a token, not ``2 * heads * head size``) needs
its own cache layout and attention kernel: a follow-up.

Rotary: the checkpoints lay a rotary head's features out in interleaved pairs
``(x0, x1), (x2, x3), ...`` (DeepSeek-V2 always, V3 with ``rope_interleave``); the same
permutation of query and key features leaves every score unchanged, so those features are
de-interleaved (``x0, x2, ..., x1, x3, ...``) and rotated by the shared GPT-NeoX rotary
op. With a YaRN rope whose ``mscale_all_dim`` is set (DeepSeek's long-context configs),
the softmax scale gains YaRN's ``mscale`` squared, as the reference implementation does.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers import Attention, Linear, ModelBuildContext, RMSNorm, get_rotary_embedding
from tokenmill.plugin_api import AttentionMetadata

# the latent and query-latent norms use the reference implementation's default, not rms_norm_eps
LATENT_NORM_EPS = 1e-6


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature for a context stretched ``factor`` times."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_softmax_scale(config: Any) -> float:
    """``1 / sqrt(qk_head_dim)``, times YaRN's ``mscale(factor, mscale_all_dim)`` squared
    when the rope is scaled and says ``mscale_all_dim``."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = getattr(config, "rope_parameters", None) or {}
    if params.get("rope_type", params.get("type", "default")) != "default" and params.get("mscale_all_dim"):
        mscale = yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"]))
        scale *= mscale * mscale
    return scale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` features ``x0, x1, x2, x3, ...`` -> ``x0, x2, ..., x1, x3, ...`` (contiguous)."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2).contiguous()


class MLAttention(nn.Module):
    """Latent attention of one layer: ``forward(positions [T], hidden [T, H], metadata)``.

    Under tensor parallelism the heads are split over the ranks (``q_b_proj`` / ``q_proj``
    and ``kv_b_proj`` column-parallel by head, ``o_proj`` row-parallel); the latent
    projections are small and replicated."""

    def __init__(self, config: Any, layer_index: int, ctx: ModelBuildContext, *, rope_interleaved: bool) -> None:
        super().__init__()
        total_heads = config.num_attention_heads
        if total_heads % ctx.world_size:
            raise ValueError(f"num_attention_heads {total_heads} does not split over {ctx.world_size} ranks")
        self.num_heads = total_heads // ctx.world_size
        self.nope_size, self.rope_size = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_size = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.rope_interleaved = rope_interleaved
        qk_size = self.nope_size + self.rope_size
        bias = bool(getattr(config, "attention_bias", False))
        hidden = config.hidden_size
        q_lora_rank = getattr(config, "q_lora_rank", None)
        self.q_proj: Linear | None = None
        self.q_a_proj: Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: Linear | None = None
        if q_lora_rank:
            self.q_a_proj = Linear(hidden, q_lora_rank, bias=bias, ctx=ctx.child("q_a_proj"))
            self.q_a_layernorm = RMSNorm(q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(q_lora_rank, total_heads * qk_size, ctx=ctx.child("q_b_proj"), parallel="column")
        else:
            self.q_proj = Linear(hidden, total_heads * qk_size, ctx=ctx.child("q_proj"), parallel="column")
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.rope_size, bias=bias,
                                         ctx=ctx.child("kv_a_proj_with_mqa"))
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(self.kv_lora_rank, total_heads * (self.nope_size + self.v_size),
                                ctx=ctx.child("kv_b_proj"), parallel="column")
        self.o_proj = Linear(total_heads * self.v_size, hidden, bias=bias, ctx=ctx.child("o_proj"), parallel="row")
        self.rotary_emb = get_rotary_embedding(ctx, self.rope_size, config.max_position_embeddings)
        # the cache's head size: the longer of a key (nope + rope) and a value
        self.head_size = max(qk_size, self.v_size)
        self.attn = Attention(self.num_heads, self.head_size, self.num_heads, mla_softmax_scale(config),
                              None, layer_index)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        tokens, heads = hidden.shape[0], self.num_heads
        q_nope, q_rot = self._query(hidden).view(tokens, heads, -1).split([self.nope_size, self.rope_size], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.rope_size], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent.contiguous())).view(tokens, heads, -1)
        k_nope, value = kv.split([self.nope_size, self.v_size], dim=-1)
        q_rot, k_rot = self.rotary_emb(positions, self._rope_layout(q_rot),
                                       self._rope_layout(k_rot.reshape(tokens, 1, self.rope_size)))
        query = self._pad(torch.cat([q_nope, q_rot], dim=-1))
        key = self._pad(torch.cat([k_nope, k_rot.expand(tokens, heads, self.rope_size)], dim=-1))
        out = self.attn(query.reshape(tokens, -1), key.reshape(tokens, -1), self._pad(value).reshape(tokens, -1),
                        metadata)
        out = out.view(tokens, heads, self.head_size)[..., : self.v_size]
        return self.o_proj(out.reshape(tokens, heads * self.v_size))

    def _query(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.q_proj is not None:
            return self.q_proj(hidden)
        assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))

    def _rope_layout(self, x: torch.Tensor) -> torch.Tensor:
        return deinterleave(x) if self.rope_interleaved else x.contiguous()

    def _pad(self, x: torch.Tensor) -> torch.Tensor:
        """Zero features up to the cache's head size (they add nothing to a score)."""
        missing = self.head_size - x.shape[-1]
        return F.pad(x, (0, missing)) if missing else x.contiguous()
