"""DeepSeek's multi-head latent attention (MLA), over a compressed latent KV cache.

Keys and values come from one small latent per token: ``kv_a_proj_with_mqa`` projects
the hidden state to ``kv_lora_rank`` latent features plus ``qk_rope_head_dim`` rotary
features shared by all heads; the latent is RMS-normed (``kv_a_layernorm``) and
``kv_b_proj`` expands it into every head's non-rotary key part (``qk_nope_head_dim``)
and its value (``v_head_dim``). A head's key is its non-rotary part followed by the
shared rotary part; its query likewise (through ``q_a_proj`` / ``q_a_layernorm`` /
``q_b_proj`` when the config has a ``q_lora_rank``, else one ``q_proj``).

The KV cache holds the compressed entry alone: the normed latent followed by the rotated
shared rotary key, ``kv_lora_rank + qk_rope_head_dim`` numbers a token and layer (a
``"latent"`` :class:`tokenmill.plugin_api.KVCacheSpec`, through
:class:`tokenmill.layers.LatentAttention`), where caching decompressed keys and values took
``2 * heads * max(qk_nope + qk_rope, v)``. Attention runs in the absorbed form: ``kv_b_proj``'s
key half ``W_UK`` [heads, qk_nope, kv_lora_rank] is folded into the queries (a head's
non-rotary query times ``W_UK`` scores directly against the cached latents, since ``q . (W_UK
c) = (q W_UK) . c``), the rotary parts score as they are, the softmax-weighted sum is taken of
the latents, and only that sum goes through the value half ``W_UV`` and then ``o_proj``. The
attention itself is ``tokenmill.attention.latent``'s torch/SDPA reference (whichever backend
serves other models); under tensor parallelism the heads split over the ranks and each rank
caches the whole latent (it is shared by every head).

Rotary: the checkpoints lay a rotary head's features out in interleaved pairs
``(x0, x1), (x2, x3), ...`` (DeepSeek-V2 always, V3 with ``rope_interleave``); the same
permutation of query and key features leaves every score unchanged, so those features are
de-interleaved (``x0, x2, ..., x1, x3, ...``) and rotated by the shared GPT-NeoX rotary
op (and cached so). With a YaRN rope whose ``mscale_all_dim`` is set (DeepSeek's long-context
configs), the softmax scale gains YaRN's ``mscale`` squared, as the reference implementation does.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from torch import nn

from tokenmill.layers import (
    LatentAttention,
    Linear,
    ModelBuildContext,
    RMSNorm,
    UnquantizedLinearMethod,
    get_rotary_embedding,
)
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
    projections are small and replicated, and so is the cached latent."""

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
        # the cache's entry: the latent, then the rotary key; the latent is every head's value
        self.attn = LatentAttention(self.num_heads, self.kv_lora_rank + self.rope_size, self.kv_lora_rank,
                                    mla_softmax_scale(config), layer_index)
        self._dequantized_up: torch.Tensor | None = None  # kv_b_proj's weight, for a quantized kv_b_proj

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        tokens, heads = hidden.shape[0], self.num_heads
        q_nope, q_rot = self._query(hidden).view(tokens, heads, -1).split([self.nope_size, self.rope_size], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.rope_size], dim=-1)
        q_rot, k_rot = self.rotary_emb(positions, self._rope_layout(q_rot),
                                       self._rope_layout(k_rot.reshape(tokens, 1, self.rope_size)))
        key_up, value_up = self._up_projections(hidden)
        q_latent = torch.bmm(q_nope.transpose(0, 1), key_up).transpose(0, 1)  # W_UK absorbed: [T, heads, latent]
        query = torch.cat([q_latent, q_rot], dim=-1)
        entry = torch.cat([self.kv_a_layernorm(latent.contiguous()), k_rot.reshape(tokens, self.rope_size)], dim=-1)
        out = self.attn(query.reshape(tokens, -1), entry, metadata).view(tokens, heads, self.kv_lora_rank)
        out = torch.bmm(out.transpose(0, 1), value_up.transpose(1, 2)).transpose(0, 1)  # W_UV: [T, heads, v]
        return self.o_proj(out.reshape(tokens, heads * self.v_size))

    def _query(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.q_proj is not None:
            return self.q_proj(hidden)
        assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))

    def _rope_layout(self, x: torch.Tensor) -> torch.Tensor:
        return deinterleave(x) if self.rope_interleaved else x.contiguous()

    def _up_projections(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv_b_proj``'s key half ``W_UK`` [heads, nope, latent] and value half ``W_UV``
        [heads, v, latent], views of its weight [heads * (nope + v), latent]."""
        weight = self._up_weight(like).view(self.num_heads, self.nope_size + self.v_size, self.kv_lora_rank)
        key_up, value_up = weight.split([self.nope_size, self.v_size], dim=1)
        return key_up, value_up

    def _up_weight(self, like: torch.Tensor) -> torch.Tensor:
        """The float layer's own weight (nothing copied, never stale); a quantized layer's,
        dequantized once by applying it to the identity (whatever its method), in ``like``'s dtype."""
        if isinstance(self.kv_b_proj.quant_method, UnquantizedLinearMethod):
            return cast(torch.Tensor, self.kv_b_proj.weight)
        if self._dequantized_up is None:
            identity = torch.eye(self.kv_lora_rank, dtype=like.dtype, device=like.device)
            self._dequantized_up = self.kv_b_proj(identity).T.contiguous()
        return self._dequantized_up
