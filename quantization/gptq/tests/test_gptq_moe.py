"""GPTQ experts through the FusedMoE quant-method slot: a MoE checkpoint whose experts are
stored GPTQ-packed (``experts.N.w1.qweight`` / ``qzeros`` / ``scales`` / ``g_idx``, the
linear layers' layout, tests/gptq_models.py's packer) runs as its dequantised twin.

The layer against the float reference op on the dequantised weights (the same float32
arithmetic, grouped differently: 1e-5), for top-k 1/2/8 and experts without tokens;
whole tiny Mixtral / Qwen2-MoE checkpoints against transformers on the dequantised twin
(greedy tokens scored by transformers, as the dense GPTQ tests score them); and the
errors that name a missing or misshapen expert tensor."""

from __future__ import annotations

import random

import pytest
import torch
from gptq_models import EXPERTS, LINEAR, GptqRecipe, build_gptq_pair, gptq_tensors, quantize
from moe_models import build_moe_model
from quant_agreement import agreement_with_transformers, greedy_with_logprobs

from tokenmill.layers import FusedMoE, MoERouting, NativeLayerOps, packed_int_kernel_runs, select_experts
from tokenmill_quant_gptq.method import GptqScheme
from tokenmill_quant_gptq.moe import GptqFusedMoEMethod

HIDDEN, INTER, NUM_EXPERTS = 64, 48, 8
NAMES = ("w1", "w3", "w2")  # Mixtral's (gate, up, down)
# (v1's zero - 1 cannot store a zero of 0, which small asymmetric groups of random weights hit)
RECIPES = [GptqRecipe(bits=4, group_size=32, sym=True),
           GptqRecipe(bits=4, group_size=16, sym=False, desc_act=True, checkpoint_format="gptq_v2"),
           GptqRecipe(bits=4, group_size=-1, sym=False)]


def _scheme(recipe: GptqRecipe) -> GptqScheme:
    return GptqScheme(bits=recipe.bits, group_size=recipe.group_size, desc_act=recipe.desc_act, sym=recipe.sym,
                      zero_version=1 if recipe.checkpoint_format == "gptq" else 2)


def _expert_tensors(recipe: GptqRecipe, seed: int = 0):
    """Per-expert GPTQ tensors of random experts (``{"3.w1.qweight": ...}``), and the
    dequantised stacks ``gate_up [E, 2I, H]`` and ``down [E, H, I]``."""
    torch.manual_seed(seed)
    tensors, gate_up, down = {}, [], []
    for expert in range(NUM_EXPERTS):
        order = torch.randperm(HIDDEN) if recipe.desc_act else None  # gate and up share their input's order
        dequantised = {}
        for name, shape, perm in (("w1", (INTER, HIDDEN), order), ("w3", (INTER, HIDDEN), order),
                                  ("w2", (HIDDEN, INTER), torch.randperm(INTER) if recipe.desc_act else None)):
            layer = quantize(torch.randn(shape) * 0.2, recipe, perm)
            tensors.update({f"{expert}.{name}.{leaf}": value for leaf, value in gptq_tensors(layer, recipe).items()})
            dequantised[name] = layer.dequantized()
        gate_up.append(torch.cat([dequantised["w1"], dequantised["w3"]]))
        down.append(dequantised["w2"])
    return tensors, torch.stack(gate_up), torch.stack(down)


def _layer(recipe: GptqRecipe, top_k: int = 2) -> FusedMoE:
    return FusedMoE(NUM_EXPERTS, HIDDEN, INTER, MoERouting(top_k=top_k, renormalize=True),
                    quant_method=GptqFusedMoEMethod(_scheme(recipe)), expert_names=NAMES)


def _loaded_layer(recipe: GptqRecipe, tensors: dict[str, torch.Tensor], top_k: int = 2) -> FusedMoE:
    layer = _layer(recipe, top_k)
    for name, tensor in tensors.items():
        layer.load_checkpoint_tensor(name, tensor)
    assert layer.missing_checkpoint_tensors() == []
    layer.quant_method.process_weights_after_loading(layer)  # type: ignore[attr-defined]
    return layer


@pytest.mark.parametrize("recipe", RECIPES, ids=str)
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_gptq_experts_match_the_reference_on_dequantised_weights(recipe, top_k, tokens):
    tensors, gate_up, down = _expert_tensors(recipe, seed=top_k * 100 + tokens)
    layer = _loaded_layer(recipe, tensors, top_k)
    assert layer.gate_up_proj_qweight.dtype == torch.int32
    assert layer.gate_up_proj_qweight.shape == (NUM_EXPERTS, HIDDEN // 8, 2 * INTER)
    assert not hasattr(layer, "gate_up_proj")  # no float copy of the experts is kept
    # the packed-int CPU kernel runs the experts wherever it runs the linear layers
    assert (layer.quant_method.cpu_experts is not None) == packed_int_kernel_runs()  # type: ignore[union-attr]
    torch.manual_seed(tokens)
    x, logits = torch.randn(tokens, HIDDEN), torch.randn(tokens, NUM_EXPERTS)
    weights, ids = select_experts(logits, layer.routing)
    reference = NativeLayerOps().fused_moe(x, gate_up, down, weights, ids)
    torch.testing.assert_close(layer(x, logits), reference, rtol=1e-5, atol=1e-5)


def test_an_expert_tensor_that_never_came_is_named():
    recipe = RECIPES[0]
    tensors, _, _ = _expert_tensors(recipe)
    layer = _layer(recipe)
    for name, tensor in tensors.items():
        if name != "5.w3.scales":
            layer.load_checkpoint_tensor(name, tensor)
    assert layer.missing_checkpoint_tensors() == [f"{layer.prefix}.5.w3.scales"]


def test_a_misshapen_or_float_expert_tensor_is_refused_by_name():
    recipe = RECIPES[0]
    tensors, _, _ = _expert_tensors(recipe)
    with pytest.raises(ValueError, match=r"2\.w2\.scales: checkpoint tensor of shape \(1, 64\)"):
        _layer(recipe).load_checkpoint_tensor("2.w2.scales", tensors["2.w2.scales"][:1])
    with pytest.raises(ValueError, match=r"4\.w1\.qweight: expected packed int32"):
        _layer(recipe).load_checkpoint_tensor("4.w1.qweight", tensors["4.w1.qweight"].float())
    with pytest.raises(KeyError, match=r"3\.w1\.weight' has no per-expert parameter"):
        _layer(recipe).load_checkpoint_tensor("3.w1.weight", torch.zeros(INTER, HIDDEN))


def test_gate_and_up_with_different_act_orders_are_refused():
    recipe = RECIPES[1]
    tensors, _, _ = _expert_tensors(recipe)
    layer = _layer(recipe)
    layer.load_checkpoint_tensor("0.w1.g_idx", tensors["0.w1.g_idx"])
    with pytest.raises(ValueError, match=r"0\.w3\.g_idx: the expert's gate and up projections have different"):
        layer.load_checkpoint_tensor("0.w3.g_idx", tensors["0.w3.g_idx"].flip(0))


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 380) for _ in range(n)] for n in (5, 9, 17, 23, 31, 40, 47, 60)]


MAX_NEW = 12


@pytest.mark.parametrize(("arch", "recipe"), [("mixtral", RECIPES[0]), ("mixtral", RECIPES[1]),
                                              ("qwen2-moe", RECIPES[2])], ids=str)
def test_gptq_moe_checkpoint_generates_like_transformers_on_dequantised_weights(arch, recipe, tmp_path):
    float_folder = build_moe_model(tmp_path / "float", arch)
    quantized, dequantized = tmp_path / "gptq", tmp_path / "dequantized"
    build_gptq_pair(float_folder, quantized, dequantized, recipe, linear=LINEAR + EXPERTS)
    prompts = _prompts()
    tokens, logprobs = greedy_with_logprobs(quantized, prompts, MAX_NEW)
    agreement = agreement_with_transformers(dequantized, prompts, tokens, logprobs)
    # weight-only: the same float32 arithmetic as the twin, up to summation order
    assert agreement.fraction == 1.0, agreement
    assert agreement.max_logprob_error <= 1e-3, agreement
    assert (tokens, logprobs) != greedy_with_logprobs(float_folder, prompts, MAX_NEW), "quantization changed nothing"


def test_gptq_experts_placed_whole_on_two_expert_parallel_ranks_sum_to_the_whole_layer():
    """Expert parallelism: each rank stacks its 4 experts' packed tensors (the loader's
    ``expert_id`` is the index in that stack), skips the others', and the two partial outputs
    add up to the one-rank layer's; a missing tensor is named by its global expert id."""
    from tokenmill.layers import ModelBuildContext

    recipe = RECIPES[1]  # desc_act: each expert's g_idx travels with it
    tensors, _, _ = _expert_tensors(recipe, seed=5)
    whole = _loaded_layer(recipe, tensors)
    torch.manual_seed(5)
    x, logits = torch.randn(9, HIDDEN), torch.randn(9, NUM_EXPERTS)
    total = torch.zeros(9, HIDDEN)
    for rank in range(2):
        ctx = ModelBuildContext(hf_config=None, prefix="experts", rank=rank, world_size=2,
                                params_dtype=torch.float32, expert_parallel=True)
        layer = FusedMoE(NUM_EXPERTS, HIDDEN, INTER, MoERouting(top_k=2, renormalize=True), ctx=ctx,
                         quant_method=GptqFusedMoEMethod(_scheme(recipe)), expert_names=NAMES, reduce_results=False)
        for name, tensor in tensors.items():
            if name != f"{4 * rank + 1}.w2.qzeros":
                layer.load_checkpoint_tensor(name, tensor)
        assert layer.missing_checkpoint_tensors() == [f"experts.{4 * rank + 1}.w2.qzeros"]
        layer.load_checkpoint_tensor(f"{4 * rank + 1}.w2.qzeros", tensors[f"{4 * rank + 1}.w2.qzeros"])
        assert layer.gate_up_proj_qweight.shape == (4, HIDDEN // 8, 2 * INTER)
        layer.quant_method.process_weights_after_loading(layer)  # type: ignore[attr-defined]
        total += layer(x, logits)
    torch.testing.assert_close(total, whole(x, logits), rtol=1e-5, atol=1e-5)


def _tensor_parallel_layer(recipe: GptqRecipe, rank: int, world_size: int) -> FusedMoE:
    from tokenmill.layers import ModelBuildContext

    ctx = ModelBuildContext(hf_config=None, prefix="experts", rank=rank, world_size=world_size,
                            params_dtype=torch.float32)
    return FusedMoE(NUM_EXPERTS, HIDDEN, INTER, MoERouting(top_k=2, renormalize=True), ctx=ctx,
                    quant_method=GptqFusedMoEMethod(_scheme(recipe)), expert_names=NAMES, reduce_results=False)


@pytest.mark.parametrize("recipe", [GptqRecipe(bits=4, group_size=8, sym=True),  # each rank its own groups
                                    RECIPES[1],  # act-order: every rank keeps all groups, its rows' g_idx
                                    RECIPES[2]], ids=str)  # one group over all inputs
def test_gptq_experts_split_over_two_tensor_parallel_ranks_sum_to_the_dequantised_layer(recipe):
    """Tensor parallelism: each rank loads the whole checkpoint tensors and keeps its half of
    every expert's intermediate dimension (gate/up columns, down rows and their groups); the two
    partial outputs add up to the float reference on the dequantised weights."""
    tensors, gate_up, down = _expert_tensors(recipe, seed=7)
    torch.manual_seed(7)
    x, logits = torch.randn(11, HIDDEN), torch.randn(11, NUM_EXPERTS)
    total = torch.zeros(11, HIDDEN)
    for rank in range(2):
        layer = _tensor_parallel_layer(recipe, rank, 2)
        for name, tensor in tensors.items():
            layer.load_checkpoint_tensor(name, tensor)
        assert layer.missing_checkpoint_tensors() == []
        assert layer.gate_up_proj_qweight.shape == (NUM_EXPERTS, HIDDEN // 8, INTER)
        assert layer.down_proj_qweight.shape == (NUM_EXPERTS, INTER // 2 // 8, HIDDEN)
        layer.quant_method.process_weights_after_loading(layer)  # type: ignore[attr-defined]
        total += layer(x, logits)
    weights, ids = select_experts(logits, MoERouting(top_k=2, renormalize=True))
    reference = NativeLayerOps().fused_moe(x, gate_up, down, weights, ids)
    torch.testing.assert_close(total, reference, rtol=1e-5, atol=1e-5)


def test_gptq_groups_that_would_straddle_two_tensor_parallel_ranks_are_refused_with_the_sizes():
    with pytest.raises(ValueError, match=r"intermediate size of 48 over 2 tensor-parallel ranks is 24 per rank, "
                                         r"not a multiple of GPTQ group_size 32"):
        _tensor_parallel_layer(RECIPES[0], 0, 2)


def test_a_gptq_mixtral_over_two_tensor_parallel_ranks_generates_what_one_rank_generates(tmp_path):
    """The tiny Mixtral (8 experts of intermediate 128) written as an act-order GPTQ checkpoint,
    run by two worker processes (the "mp" executor): each rank holds 64 of every expert's
    intermediate features (all of down's groups, its rows' g_idx). The same float32 products
    summed in another order: tokens equal, logprobs within 1e-4."""
    float_folder = build_moe_model(tmp_path / "float", "mixtral")
    quantized = tmp_path / "gptq"
    build_gptq_pair(float_folder, quantized, tmp_path / "dequantized",
                    GptqRecipe(bits=4, group_size=32, desc_act=True, checkpoint_format="gptq_v2"),
                    linear=LINEAR + EXPERTS)
    prompts = _prompts()
    one = greedy_with_logprobs(quantized, prompts, MAX_NEW)
    two = greedy_with_logprobs(quantized, prompts, MAX_NEW, tensor_parallel_size=2, distributed_executor_backend="mp")
    assert two[0] == one[0]
    assert max(abs(a - b) for ours, theirs in zip(one[1], two[1], strict=True)
               for a, b in zip(ours, theirs, strict=True)) < 1e-4
