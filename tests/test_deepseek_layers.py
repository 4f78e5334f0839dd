"""DeepSeek pieces against transformers' own: the latent attention's softmax scale under
YaRN, the layers that get experts, and the config checks."""

from __future__ import annotations

import pytest
import torch
import transformers

from tokenmill_models_moe.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, deepseek_sparse_layers
from tokenmill_models_moe.mla import deinterleave, mla_softmax_scale

_MLA = dict(hidden_size=64, num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=24, qk_rope_head_dim=8,
            v_head_dim=16, max_position_embeddings=128)
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
         "mscale": 1.0, "mscale_all_dim": 0.707}


@pytest.mark.parametrize("rope", [None, _YARN, {**_YARN, "mscale_all_dim": 0}])
def test_softmax_scale_matches_transformers(rope):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    config = transformers.DeepseekV3Config(**_MLA, rope_parameters=rope)
    assert mla_softmax_scale(config) == pytest.approx(DeepseekV3Attention(config, 0).scaling, rel=1e-12)
    if rope and rope["mscale_all_dim"]:
        assert mla_softmax_scale(config) != pytest.approx(32**-0.5)


def test_deinterleaving_rotates_pairs_as_deepseek_v2_does():
    """A rotary pair (x0, x1) rotated as one complex number (DeepSeek-V2's form) gives the
    GPT-NeoX rotation of the de-interleaved features, de-interleaved."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import apply_rotary_emb

    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 1, 5, 8)
    angles = torch.randn(1, 5, 4)
    hf_q, hf_k = apply_rotary_emb(q, k, torch.polar(torch.ones_like(angles), angles))
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]

    def neox(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    torch.testing.assert_close(neox(deinterleave(q)), deinterleave(hf_q))
    torch.testing.assert_close(neox(deinterleave(k)), deinterleave(hf_k))


@pytest.mark.parametrize(("first_dense", "every", "expected"), [
    (0, 1, {0, 1, 2, 3, 4, 5}), (1, 1, {1, 2, 3, 4, 5}), (3, 1, {3, 4, 5}), (1, 2, {2, 4}),
])
def test_the_layers_with_experts(first_dense, every, expected):
    config = transformers.DeepseekV3Config(num_hidden_layers=6, first_k_dense_replace=first_dense,
                                           moe_layer_freq=every)
    assert deepseek_sparse_layers(config) == frozenset(expected)


def test_v3_routes_by_sigmoid_with_a_bias_whatever_the_config_names():
    config = transformers.DeepseekV3Config(n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                                           routed_scaling_factor=2.5, norm_topk_prob=True)
    routing = DeepseekV3ForCausalLM.routing(config)
    assert (routing.scoring, routing.correction_bias, routing.num_groups, routing.top_groups) == ("sigmoid", True, 4, 2)
    assert (routing.renormalize, routing.scaling_factor) == (True, 2.5)


def test_v2_routing_reads_topk_method_and_rejects_an_unknown_one():
    config = transformers.DeepseekV2Config(n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                                           topk_method="group_limited_greedy", routed_scaling_factor=1.5)
    routing = DeepseekV2ForCausalLM.routing(config)
    assert (routing.scoring, routing.num_groups, routing.renormalize, routing.scaling_factor) == ("softmax", 4, False,
                                                                                                  1.5)
    config.topk_method = "random"
    with pytest.raises(ValueError, match="topk_method='random'"):
        DeepseekV2ForCausalLM.routing(config)


def test_a_biased_mlp_is_refused_by_name():
    config = transformers.DeepseekV2Config(n_routed_experts=8, num_experts_per_tok=2, mlp_bias=True)
    with pytest.raises(ValueError, match="mlp_bias=True"):
        DeepseekV2ForCausalLM.moe_shape(config)
