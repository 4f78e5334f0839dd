"""The FusedMoE layer: routing against transformers' routers, the layer against
transformers' sparse MoE block on the same weights, the expert weight loader (per-expert
and stacked checkpoints, tensor-parallel slices, errors that name the tensor)."""

from __future__ import annotations

import pytest
import torch
import transformers

from tokenmill.layers import FusedMoE, ModelBuildContext, MoERouting, check_experts_loaded, select_experts

HIDDEN, INTER, EXPERTS = 32, 24, 8


def _dense(weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[T, k] weights at expert ids -> [T, E] (the order of the k picks does not matter)."""
    return torch.zeros(ids.shape[0], EXPERTS).scatter_(1, ids, weights)


def _hf_config(name: str, **extra):
    return getattr(transformers, name)(hidden_size=HIDDEN, intermediate_size=INTER, moe_intermediate_size=INTER,
                                       num_local_experts=EXPERTS, num_experts=EXPERTS, num_experts_per_tok=2, **extra)


@pytest.mark.parametrize(("config_name", "router_name", "extra", "renormalize_default"), [
    ("MixtralConfig", "MixtralTopKRouter", {}, True),
    ("Qwen2MoeConfig", "Qwen2MoeTopKRouter", {"norm_topk_prob": False}, False),
    ("Qwen3MoeConfig", "Qwen3MoeTopKRouter", {"norm_topk_prob": True}, False),
])
def test_softmax_routing_matches_transformers(config_name, router_name, extra, renormalize_default):
    torch.manual_seed(0)
    config = _hf_config(config_name, **extra)
    module = getattr(transformers.models, config.model_type.replace("-", "_"))
    router = getattr(getattr(module, f"modeling_{config.model_type}"), router_name)(config)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(50, HIDDEN)
    _, hf_weights, hf_ids = router(x)
    weights, ids = select_experts(torch.nn.functional.linear(x, router.weight),
                                  MoERouting.from_hf_config(config, renormalize_default=renormalize_default))
    torch.testing.assert_close(_dense(weights, ids), _dense(hf_weights.float(), hf_ids), rtol=0, atol=1e-6)


def test_grouped_sigmoid_routing_with_a_correction_bias_matches_deepseek_v3():
    torch.manual_seed(1)
    config = transformers.DeepseekV3Config(hidden_size=HIDDEN, n_routed_experts=EXPERTS, num_experts_per_tok=2,
                                           n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    router = DeepseekV3TopkRouter(config)
    torch.nn.init.normal_(router.weight)
    router.e_score_correction_bias.normal_(0, 0.5)  # large enough to change choices
    x = torch.randn(50, HIDDEN)
    _, hf_weights, hf_ids = router(x)
    routing = MoERouting(top_k=2, scoring="sigmoid", renormalize=True, num_groups=4, top_groups=2,
                         scaling_factor=2.5, correction_bias=True)
    weights, ids = select_experts(torch.nn.functional.linear(x, router.weight), routing, router.e_score_correction_bias)
    torch.testing.assert_close(_dense(weights, ids), _dense(hf_weights, hf_ids), rtol=0, atol=1e-6)
    unbiased, _ = select_experts(torch.nn.functional.linear(x, router.weight), routing, None)
    assert not torch.equal(_dense(unbiased, ids), _dense(weights, ids))  # the bias did change the picks


def _mixtral_block(seed: int = 0):
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    torch.manual_seed(seed)
    config = _hf_config("MixtralConfig")
    block = MixtralSparseMoeBlock(config)
    for param in block.parameters():
        torch.nn.init.normal_(param, 0, 0.2)
    return block


def _per_expert_tensors(block) -> dict[str, torch.Tensor]:
    """The block's stacked weights as a checkpoint stores them: experts.N.w1/w3/w2."""
    gate_up, down = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    tensors = {}
    for e in range(EXPERTS):
        tensors[f"{e}.w1.weight"], tensors[f"{e}.w3.weight"] = gate_up[e].chunk(2, dim=0)
        tensors[f"{e}.w2.weight"] = down[e]
    return tensors


def _layer(ctx: ModelBuildContext | None = None) -> FusedMoE:
    ctx = ctx or ModelBuildContext(hf_config=None, params_dtype=torch.float32, prefix="model.layers.0.moe.experts")
    return FusedMoE(EXPERTS, HIDDEN, INTER, MoERouting(top_k=2, renormalize=True), ctx=ctx,
                    expert_names=("w1", "w3", "w2"))


@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_the_layer_matches_transformers_block_from_per_expert_tensors(tokens):
    block = _mixtral_block()
    layer = _layer()
    for name, tensor in _per_expert_tensors(block).items():
        layer.load_checkpoint_tensor(name, tensor)
    check_experts_loaded(layer)
    x = torch.randn(tokens, HIDDEN)
    with torch.no_grad():
        expected = block(x.unsqueeze(0))[0]
        got = layer(x, torch.nn.functional.linear(x, block.gate.weight))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_a_stacked_checkpoint_loads_as_the_per_expert_one():
    block = _mixtral_block(1)
    per_expert, stacked = _layer(), _layer()
    for name, tensor in _per_expert_tensors(block).items():
        per_expert.load_checkpoint_tensor(name, tensor)
    stacked.load_checkpoint_tensor("gate_up_proj", block.experts.gate_up_proj.detach())
    stacked.load_checkpoint_tensor("down_proj", block.experts.down_proj.detach())
    assert stacked.missing_checkpoint_tensors() == []
    assert torch.equal(stacked.gate_up_proj, per_expert.gate_up_proj)
    assert torch.equal(stacked.down_proj, per_expert.down_proj)


@pytest.mark.parametrize("stacked", [False, True])
def test_two_ranks_partial_outputs_sum_to_the_whole_layer(stacked):
    """Each rank holds half of every expert's intermediate columns (gate, up and down alike)."""
    block = _mixtral_block(2)
    whole = _layer()
    for name, tensor in _per_expert_tensors(block).items():
        whole.load_checkpoint_tensor(name, tensor)
    x = torch.randn(9, HIDDEN)
    logits = torch.randn(9, EXPERTS)
    partials = []
    for rank in range(2):
        layer = _layer(ModelBuildContext(hf_config=None, rank=rank, world_size=2, params_dtype=torch.float32))
        assert layer.gate_up_proj.shape == (EXPERTS, INTER, HIDDEN) and layer.down_proj.shape == (EXPERTS, HIDDEN, INTER // 2)
        if stacked:
            layer.load_checkpoint_tensor("gate_up_proj", block.experts.gate_up_proj.detach())
            layer.load_checkpoint_tensor("down_proj", block.experts.down_proj.detach())
        else:
            for name, tensor in _per_expert_tensors(block).items():
                layer.load_checkpoint_tensor(name, tensor)
        partials.append(layer(x, logits))  # the one-rank communicator: the all-reduce is ours
    torch.testing.assert_close(partials[0] + partials[1], whole(x, logits), rtol=1e-5, atol=1e-5)


def test_a_missing_expert_tensor_is_named():
    layer = _layer()
    tensors = _per_expert_tensors(_mixtral_block())
    del tensors["6.w3.weight"]
    for name, tensor in tensors.items():
        layer.load_checkpoint_tensor(name, tensor)
    with pytest.raises(ValueError, match=r"lacks expert tensor model\.layers\.0\.moe\.experts\.6\.w3\.weight$"):
        check_experts_loaded(layer)


@pytest.mark.parametrize(("name", "shape", "message"), [
    ("3.w1.weight", (INTER + 1, HIDDEN), r"experts\.3\.w1\.weight: checkpoint tensor of shape \(25, 32\)"),
    ("5.w2.weight", (HIDDEN, INTER - 1), r"experts\.5\.w2\.weight: checkpoint tensor of shape \(32, 23\)"),
    ("gate_up_proj", (EXPERTS, 2 * INTER, HIDDEN + 1), r"experts\.gate_up_proj: checkpoint tensor of shape"),
])
def test_a_mismatched_expert_shape_is_named(name, shape, message):
    with pytest.raises(ValueError, match=message):
        _layer().load_checkpoint_tensor(name, torch.zeros(shape))


def test_an_expert_beyond_the_layer_is_named():
    with pytest.raises(KeyError, match=r"experts\.8\.w1\.weight.*8 experts"):
        _layer().load_checkpoint_tensor("8.w1.weight", torch.zeros(INTER, HIDDEN))


@pytest.mark.parametrize(("field", "value"), [("scoring_func", "softplus"), ("topk_method", "sinkhorn")])
def test_an_unsupported_routing_names_the_config_field(field, value):
    config = _hf_config("Qwen2MoeConfig", **{field: value})
    with pytest.raises(ValueError, match=f"{field}='{value}'"):
        MoERouting.from_hf_config(config)


class _BFloat16Experts:
    """A method of the quant-method slot: experts stored in bfloat16, computed in float32."""

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_rank, params_dtype):
        layer.add_parameter("gate_up_proj", torch.empty(num_experts, 2 * intermediate_size_per_rank, hidden_size,
                                                        dtype=torch.bfloat16), layout="gate_up")
        layer.add_parameter("down_proj", torch.empty(num_experts, hidden_size, intermediate_size_per_rank,
                                                     dtype=torch.bfloat16), layout="down")

    def apply(self, layer, x, topk_weights, topk_ids):
        from tokenmill.layers import layer_ops

        return layer_ops(x.device).fused_moe(x, layer.gate_up_proj.float(), layer.down_proj.float(), topk_weights,
                                             topk_ids)


def test_the_quantization_config_chooses_the_experts_method():
    from tokenmill.layers import QuantizationConfig

    class BFloat16ExpertsConfig(QuantizationConfig):
        def get_moe_method(self, layer, prefix):
            return _BFloat16Experts() if prefix.endswith(".experts") else None

    block = _mixtral_block(3)
    ctx = ModelBuildContext(hf_config=None, quant_config=BFloat16ExpertsConfig(), params_dtype=torch.float32,
                            prefix="model.layers.0.moe.experts")
    layer, float_layer = _layer(ctx), _layer()
    assert isinstance(layer.quant_method, _BFloat16Experts) and layer.gate_up_proj.dtype == torch.bfloat16
    for name, tensor in _per_expert_tensors(block).items():
        layer.load_checkpoint_tensor(name, tensor)
        float_layer.load_checkpoint_tensor(name, tensor)
    x, logits = torch.randn(5, HIDDEN), torch.randn(5, EXPERTS)
    torch.testing.assert_close(layer(x, logits), float_layer(x, logits), rtol=3e-2, atol=3e-2)
