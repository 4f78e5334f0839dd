"""The Gemma 2 and Gemma 3 (text) decoders.

Both differ from Llama in the same ways: the token embeddings are scaled by
``sqrt(hidden_size)``; every RMSNorm multiplies by ``1 + w`` (the checkpoint stores
``w``; the loader stores ``1 + w``, so the platform's plain RMSNorm kernels apply);
each layer norms the attention and MLP outputs too (four norms per layer); the MLP is
gelu-tanh gated; attention scores are scaled by ``query_pre_attn_scalar ** -0.5``;
and layers alternate between sliding-window and global attention (``layer_types``).
Gemma 2 soft-caps the attention scores and the final logits (``cap * tanh(x / cap)``);
Gemma 3 drops the caps, normalises each head of q and k, and gives its sliding and
global layers their own rope (``rope_parameters`` per layer type).

q/k/v and gate/up are merged into one matmul each and split over tensor-parallel
ranks as in the Llama family; the norms are replicated.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers import (
    Attention,
    AuxHiddenStateRecorder,
    Linear,
    MergedLinear,
    ModelBuildContext,
    ParallelLMHead,
    RMSNorm,
    VocabEmbedding,
    get_rotary_embedding,
    load_into_merged,
)
from tokenmill.plugin_api import AttentionMetadata

SLIDING = "sliding_attention"


class GemmaRMSNorm(RMSNorm):
    """RMSNorm scaled by ``1 + w``: the loader adds the one to the checkpoint's ``w``
    (in float32, as transformers does when it applies the norm)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__(hidden_size, eps)
        self.weight.weight_loader = _load_one_plus  # type: ignore[attr-defined]  # read by load_weight


def _load_one_plus(param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
    if shard_id is not None or loaded.shape != param.shape:
        raise ValueError(f"norm weight of shape {tuple(loaded.shape)} (shard {shard_id}) for {tuple(param.shape)}")
    param.data.copy_((1.0 + loaded.float()).to(param.dtype))


def _layer_type(config: Any, layer_index: int) -> str:
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return str(layer_types[layer_index])
    return SLIDING if layer_index % 2 == 0 else "full_attention"  # Gemma 2's alternation


def _rope_layer_type(config: Any, layer_type: str) -> str | None:
    """``layer_type`` if the config keeps rope parameters per layer type (Gemma 3), else None."""
    params = getattr(config, "rope_parameters", None) or {}
    return layer_type if isinstance(params.get(layer_type), dict) else None


class GemmaAttention(nn.Module):
    def __init__(self, config: Any, layer_index: int, ctx: ModelBuildContext, qk_norm: bool) -> None:
        super().__init__()
        total_heads = config.num_attention_heads
        total_kv_heads = config.num_key_value_heads
        tp = ctx.world_size
        kv_parts = min(total_kv_heads, tp)  # fewer K/V heads than ranks: each is replicated
        self.num_heads = total_heads // tp
        self.num_kv_heads = total_kv_heads // kv_parts
        self.head_size = config.head_dim
        q_size, kv_size = total_heads * self.head_size, total_kv_heads * self.head_size
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = MergedLinear(config.hidden_size, [q_size, kv_size, kv_size], bias=bias,
                                     ctx=ctx.child("qkv_proj"), parallel="column", shard_parts=[tp, kv_parts, kv_parts])
        self.o_proj = Linear(q_size, config.hidden_size, bias=bias, ctx=ctx.child("o_proj"), parallel="row")
        self.q_norm = GemmaRMSNorm(self.head_size, config.rms_norm_eps) if qk_norm else None
        self.k_norm = GemmaRMSNorm(self.head_size, config.rms_norm_eps) if qk_norm else None
        layer_type = _layer_type(config, layer_index)
        self.rotary_emb = get_rotary_embedding(ctx, self.head_size, config.max_position_embeddings,
                                               _rope_layer_type(config, layer_type))
        window = config.sliding_window if layer_type == SLIDING else None
        self.attn = Attention(self.num_heads, self.head_size, self.num_kv_heads, config.query_pre_attn_scalar**-0.5,
                              window, layer_index, logits_soft_cap=getattr(config, "attn_logit_softcapping", None))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        tokens = hidden.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q = q.view(tokens, self.num_heads, self.head_size)
        k = k.view(tokens, self.num_kv_heads, self.head_size)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q.reshape(tokens, -1), k.reshape(tokens, -1), v, metadata)
        return self.o_proj(out)


class GemmaMLP(nn.Module):
    def __init__(self, config: Any, ctx: ModelBuildContext) -> None:
        super().__init__()
        activation = getattr(config, "hidden_activation", None) or config.hidden_act
        if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"Gemma MLP activation {activation!r} is not gelu-tanh")
        self.gate_up_proj = MergedLinear(config.hidden_size, [config.intermediate_size] * 2,
                                         ctx=ctx.child("gate_up_proj"), parallel="column")
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, ctx=ctx.child("down_proj"),
                                parallel="row")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_index: int, ctx: ModelBuildContext, qk_norm: bool) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = GemmaAttention(config, layer_index, ctx.child("self_attn"), qk_norm)
        self.mlp = GemmaMLP(config, ctx.child("mlp"))
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Sandwich-norm residual block with the residual stream carried separately (as
        in the Llama family): returns (normed MLP output, residual); the next layer's
        input norm adds them."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden, metadata))
        hidden = self.pre_feedforward_layernorm.add_and_norm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class GemmaModel(nn.Module):
    embed_scale: torch.Tensor

    def __init__(self, config: Any, ctx: ModelBuildContext, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, ctx=ctx.child("embed_tokens"),
                                           parallel=True)
        # transformers multiplies by sqrt(hidden) rounded to the model's dtype
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5).to(ctx.params_dtype),
                             persistent=False)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, i, ctx.child(f"layers.{i}"), qk_norm)
                                    for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.aux_hidden_states = AuxHiddenStateRecorder(config.num_hidden_layers)  # for EAGLE-3

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The scaled token embeddings, as the first layer takes them."""
        hidden = self.embed_tokens(input_ids)
        return hidden * self.embed_scale.to(hidden.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """``inputs_embeds``: the tokens' embeddings (text rows already scaled), made by a multimodal
        model that wraps this one (Gemma 3's images in place of some tokens); None: embed ``input_ids``."""
        hidden = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        residual: torch.Tensor | None = None
        for index, layer in enumerate(self.layers):
            self.aux_hidden_states.before_layer(index, hidden, residual)
            hidden, residual = layer(positions, hidden, residual, metadata)
        self.aux_hidden_states.before_norm(hidden, residual)
        if residual is None:  # a model without layers
            return self.norm(hidden)
        return self.norm.add_and_norm(hidden, residual)


class Gemma2ForCausalLM(nn.Module):
    """Gemma 2; built as ``Gemma2ForCausalLM(hf_config, ctx=ctx)``."""

    qk_norm = False

    def __init__(self, config: Any, *, ctx: ModelBuildContext) -> None:
        super().__init__()
        if getattr(config, "use_bidirectional_attention", False):  # EmbeddingGemma: an encoder
            raise ValueError("Gemma with use_bidirectional_attention (an embedding model) is not supported")
        self.config = config
        self.model = GemmaModel(config, ctx.child("model"), self.qk_norm)
        self.final_logit_softcapping: float | None = getattr(config, "final_logit_softcapping", None)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        # A tied lm_head multiplies by the embedding table itself, in the table's form: float, or
        # the embedding method's (a GGUF table stays in its blocks).
        tied_method = self.model.embed_tokens.tied_head_method() if self.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, ctx=ctx.child("lm_head"),
                                      quant_method=tied_method)
        if self.tie_word_embeddings:
            self.model.embed_tokens.tie(self.lm_head)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of the scheduled tokens (from ``inputs_embeds`` where
        given: see :meth:`GemmaModel.forward`)."""
        return self.model(input_ids, positions, metadata, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def set_aux_hidden_state_layers(self, layer_ids: Sequence[int]) -> None:
        """Record, in every forward, the residual stream entering each of these layers, for
        EAGLE-3 (``tokenmill.layers.AuxHiddenStateRecorder``)."""
        self.model.aux_hidden_states.set_layers(layer_ids, type(self).__name__)

    def take_aux_hidden_states(self) -> torch.Tensor | None:
        return self.model.aux_hidden_states.take()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors (Hugging Face names); q/k/v and gate/up as shards of
        their merged layer. Returns the parameters loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if self.tie_word_embeddings and name.startswith("lm_head."):
                continue
            loaded.add(load_into_merged(params, name, tensor, model_name=type(self).__name__))
        return loaded


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """The Gemma 3 text decoder (``Gemma3ForCausalLM``, model type ``gemma3_text``)."""

    qk_norm = True
