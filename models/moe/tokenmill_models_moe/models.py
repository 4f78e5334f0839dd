"""Mixtral, Qwen2-MoE and Qwen3-MoE: one causal LM over :mod:`.decoder`, each family
saying how its config describes the experts (:meth:`MoEForCausalLM.moe_shape`).

- Mixtral: experts in every layer (``block_sparse_moe``, ``experts.N.w1/w3/w2``),
  softmax top-k renormalised, no q/k/v bias.
- Qwen2-MoE: q/k/v bias, a shared expert with its sigmoid gate, the top-k
  renormalised only with ``norm_topk_prob``; experts in layer ``i`` when
  ``(i + 1) % decoder_sparse_step == 0`` and ``i`` is not in ``mlp_only_layers``.
- Qwen3-MoE: Qwen2-MoE's layer rule, per-head q/k RMSNorm, no shared expert.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from tokenmill.layers import (
    QKV_GATE_UP_SHARDS,
    FusedMoE,
    ModelBuildContext,
    MoERouting,
    ParallelLMHead,
    UnquantizedLinearMethod,
    check_experts_loaded,
    load_into_merged,
)
from tokenmill.plugin_api import AttentionMetadata
from tokenmill_models_moe.decoder import AttentionFactory, MoEAttention, MoEModel, MoEShape


class MoEForCausalLM(nn.Module):
    """Built as ``Model(hf_config, ctx=ctx)``; the checkpoint's names start at ``model.``
    and ``lm_head``. A subclass gives :meth:`moe_shape` and its attention flags (or its
    own attention block, :meth:`attention_factory`)."""

    qk_norm: ClassVar[bool] = False
    # checkpoint projection name -> (merged parameter, shard index)
    stacked_params: ClassVar[Mapping[str, tuple[str, int]]] = QKV_GATE_UP_SHARDS

    def __init__(self, config: Any, *, ctx: ModelBuildContext) -> None:
        super().__init__()
        self.config = config
        self.model = MoEModel(config, ctx.child("model"), self.moe_shape(config), self.attention_factory(config))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        tied_method = UnquantizedLinearMethod() if self.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, ctx=ctx.child("lm_head"),
                                      quant_method=tied_method)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def moe_shape(cls, config: Any) -> MoEShape:
        raise NotImplementedError

    @classmethod
    def attention_factory(cls, config: Any) -> AttentionFactory:
        """The layers' attention: Llama-style, with this family's bias and q/k-norm flags."""
        return functools.partial(MoEAttention, qkv_bias=cls.qkv_bias(config), o_bias=cls.o_bias(config),
                                 qk_norm=cls.qk_norm)

    def checkpoint_name(self, name: str) -> str | None:
        """The name a checkpoint tensor loads under (a family whose checkpoint keeps a tensor
        elsewhere than this model does renames it), or None for one the model does not use."""
        return name

    @classmethod
    def qkv_bias(cls, config: Any) -> bool:
        return bool(getattr(config, "attention_bias", False))

    @classmethod
    def o_bias(cls, config: Any) -> bool:
        return bool(getattr(config, "attention_bias", False))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def set_aux_hidden_state_layers(self, layer_ids: Sequence[int]) -> None:
        """Record, in every forward, the residual stream entering each of these layers, for
        EAGLE-3 (``tokenmill.layers.AuxHiddenStateRecorder``)."""
        self.model.aux_hidden_states.set_layers(layer_ids, type(self).__name__)

    def take_aux_hidden_states(self) -> torch.Tensor | None:
        return self.model.aux_hidden_states.take()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors (Hugging Face names): expert tensors through their MoE
        layer, q/k/v and gate/up as shards of their merged layer, the rest whole. Every
        expert tensor must come (the error names the first missing one)."""
        params = dict(self.named_parameters())
        moe_layers = {name: module for name, module in self.named_modules() if isinstance(module, FusedMoE)}
        loaded: set[str] = set()
        for name, tensor in weights:
            renamed = self.checkpoint_name(name)
            if renamed is None or "rotary_emb.inv_freq" in renamed or (
                    self.tie_word_embeddings and renamed.startswith("lm_head.")):
                continue
            name = renamed
            owner, experts, rest = name.partition(".experts.")
            if experts and f"{owner}.experts" in moe_layers:
                param_name = moe_layers[f"{owner}.experts"].load_checkpoint_tensor(rest, tensor)
                loaded.add(f"{owner}.experts.{param_name}")
                continue
            loaded.add(load_into_merged(params, name, tensor, self.stacked_params, type(self).__name__))
        check_experts_loaded(self)
        return loaded


def _qwen_sparse_layers(config: Any) -> frozenset[int]:
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    return frozenset(i for i in range(config.num_hidden_layers) if i not in dense and (i + 1) % step == 0)


class MixtralForCausalLM(MoEForCausalLM):
    @classmethod
    def moe_shape(cls, config: Any) -> MoEShape:
        return MoEShape(module_name="block_sparse_moe", num_experts=config.num_local_experts,
                        intermediate_size=config.intermediate_size,
                        routing=MoERouting.from_hf_config(config, renormalize_default=True),
                        expert_names=("w1", "w3", "w2"), sparse_layers=frozenset(range(config.num_hidden_layers)))


class Qwen2MoeForCausalLM(MoEForCausalLM):
    @classmethod
    def moe_shape(cls, config: Any) -> MoEShape:
        return MoEShape(module_name="mlp", num_experts=config.num_experts,
                        intermediate_size=config.moe_intermediate_size,
                        routing=MoERouting.from_hf_config(config), expert_names=("gate_proj", "up_proj", "down_proj"),
                        shared_intermediate_size=int(getattr(config, "shared_expert_intermediate_size", 0) or 0),
                        sparse_layers=_qwen_sparse_layers(config) if config.num_experts > 0 else frozenset())

    @classmethod
    def qkv_bias(cls, config: Any) -> bool:
        return bool(getattr(config, "qkv_bias", True))  # Qwen2-MoE has always biased q/k/v

    @classmethod
    def o_bias(cls, config: Any) -> bool:
        return False


class Qwen3MoeForCausalLM(MoEForCausalLM):
    qk_norm = True

    @classmethod
    def moe_shape(cls, config: Any) -> MoEShape:
        return MoEShape(module_name="mlp", num_experts=config.num_experts,
                        intermediate_size=config.moe_intermediate_size,
                        routing=MoERouting.from_hf_config(config), expert_names=("gate_proj", "up_proj", "down_proj"),
                        sparse_layers=_qwen_sparse_layers(config) if config.num_experts > 0 else frozenset())
