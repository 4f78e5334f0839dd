"""DeepSeek-V2 and DeepSeek-V3: latent attention (:mod:`.mla`) and DeepSeek's MoE blocks.

- Layers ``i >= first_k_dense_replace`` with ``i % moe_layer_freq == 0`` have experts
  (the original DeepSeek rule; transformers reads no ``moe_layer_freq``, and every
  published checkpoint has 1), the others a dense SiLU MLP of ``intermediate_size``.
- A MoE block: the router ``mlp.gate``, ``n_routed_experts`` experts of
  ``moe_intermediate_size``, and ``n_shared_experts`` shared experts held as one dense
  MLP of ``n_shared_experts * moe_intermediate_size`` (``mlp.shared_experts``), added
  ungated to every token's output.
- V2 routes by softmax, greedy or ``group_limited_greedy`` (a group's best expert), the
  weights scaled by ``routed_scaling_factor`` (and renormalised only with
  ``norm_topk_prob``, as the original code does; the checkpoints leave it off).
- V3 routes by sigmoid plus the ``e_score_correction_bias`` (kept by checkpoints under
  ``mlp.gate``, loaded into the experts layer), within each token's ``topk_group`` best
  of ``n_group`` groups (a group's two best experts), renormalised with
  ``norm_topk_prob``, scaled by ``routed_scaling_factor``: transformers' router, whatever
  ``topk_method`` / ``scoring_func`` the config names. The checkpoints' multi-token-prediction
  layers (``model.layers.{num_hidden_layers}...``) are skipped, as transformers skips them.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, ClassVar

from tokenmill.layers import MoERouting
from tokenmill_models_moe.decoder import AttentionFactory, MoEShape
from tokenmill_models_moe.mla import MLAttention
from tokenmill_models_moe.models import MoEForCausalLM

# only the MLP's gate/up merge: MLA keeps its projections apart
_DEEPSEEK_STACKED = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def deepseek_sparse_layers(config: Any) -> frozenset[int]:
    """The layers with experts."""
    if not getattr(config, "n_routed_experts", None):
        return frozenset()
    first = int(getattr(config, "first_k_dense_replace", 0) or 0)
    every = int(getattr(config, "moe_layer_freq", 1) or 1)
    return frozenset(i for i in range(config.num_hidden_layers) if i >= first and i % every == 0)


class DeepseekForCausalLM(MoEForCausalLM):
    """What V2 and V3 share; a subclass gives :meth:`routing` and its rotary layout."""

    stacked_params: ClassVar[Mapping[str, tuple[str, int]]] = _DEEPSEEK_STACKED

    @classmethod
    def routing(cls, config: Any) -> MoERouting:
        raise NotImplementedError

    @classmethod
    def rope_interleaved(cls, config: Any) -> bool:
        raise NotImplementedError

    @classmethod
    def moe_shape(cls, config: Any) -> MoEShape:
        if getattr(config, "mlp_bias", False):
            raise ValueError("unsupported DeepSeek MLP: mlp_bias=True")
        shared = int(getattr(config, "n_shared_experts", 0) or 0)
        return MoEShape(module_name="mlp", num_experts=int(config.n_routed_experts or 0),
                        intermediate_size=config.moe_intermediate_size, routing=cls.routing(config),
                        expert_names=("gate_proj", "up_proj", "down_proj"),
                        shared_intermediate_size=shared * config.moe_intermediate_size,
                        sparse_layers=deepseek_sparse_layers(config), shared_expert_name="shared_experts",
                        shared_expert_gated=False)

    @classmethod
    def attention_factory(cls, config: Any) -> AttentionFactory:
        return functools.partial(MLAttention, rope_interleaved=cls.rope_interleaved(config))

    def checkpoint_name(self, name: str) -> str | None:
        if _layer_index(name) >= self.config.num_hidden_layers:
            return None  # V3's multi-token-prediction layers (num_nextn_predict_layers) serve no decoding here
        # the router's correction bias lives in the experts layer, which does the routing
        return name.replace(".mlp.gate.e_score_correction_bias", ".mlp.experts.e_score_correction_bias")


def _layer_index(name: str) -> int:
    """``model.layers.7.mlp...`` -> 7; -1 for a tensor outside the decoder layers."""
    parts = name.split(".")
    if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        return int(parts[2])
    return -1


class DeepseekV2ForCausalLM(DeepseekForCausalLM):
    @classmethod
    def routing(cls, config: Any) -> MoERouting:
        return MoERouting.from_hf_config(config)

    @classmethod
    def rope_interleaved(cls, config: Any) -> bool:
        return True  # V2 rotates complex pairs


class DeepseekV3ForCausalLM(DeepseekForCausalLM):
    @classmethod
    def routing(cls, config: Any) -> MoERouting:
        return MoERouting(top_k=int(config.num_experts_per_tok), scoring="sigmoid",
                          renormalize=bool(getattr(config, "norm_topk_prob", False)),
                          num_groups=int(getattr(config, "n_group", None) or 1),
                          top_groups=int(getattr(config, "topk_group", None) or 1),
                          scaling_factor=float(getattr(config, "routed_scaling_factor", None) or 1.0),
                          correction_bias=True)

    @classmethod
    def rope_interleaved(cls, config: Any) -> bool:
        return bool(getattr(config, "rope_interleave", True))
