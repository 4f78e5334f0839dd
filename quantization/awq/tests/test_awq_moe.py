"""AWQ experts through the FusedMoE quant-method slot: a MoE checkpoint whose experts are
stored in AWQ's GEMM layout (``experts.N.w1.qweight`` / ``qzeros`` / ``scales``, packed in
AWQ's interleaved nibble order by tests/awq_models.py) runs as its dequantised twin.

The layer against the float reference op on the dequantised weights, for top-k 1/2/8 and
experts without tokens; a tiny Mixtral checkpoint against transformers on the dequantised
twin; a missing or misshapen expert tensor named."""

from __future__ import annotations

import random

import pytest
import torch
from awq_models import build_awq_pair, dequantize, pack_awq, quantize
from gptq_models import EXPERTS, LINEAR
from moe_models import build_moe_model
from quant_agreement import agreement_with_transformers, greedy_with_logprobs

from tokenmill.layers import FusedMoE, MoERouting, NativeLayerOps, packed_int_kernel_runs, select_experts
from tokenmill_quant_awq.moe import AwqFusedMoEMethod

HIDDEN, INTER, NUM_EXPERTS, GROUP = 64, 48, 8, 16
NAMES = ("w1", "w3", "w2")  # Mixtral's (gate, up, down)


def _expert_tensors(seed: int = 0, group: int = GROUP):
    """Per-expert AWQ tensors of random experts, and the dequantised stacks
    ``gate_up [E, 2I, H]`` and ``down [E, H, I]``."""
    torch.manual_seed(seed)
    tensors, gate_up, down = {}, [], []
    for expert in range(NUM_EXPERTS):
        dequantised = {}
        for name, shape in (("w1", (INTER, HIDDEN)), ("w3", (INTER, HIDDEN)), ("w2", (HIDDEN, INTER))):
            q, zeros, scales = quantize(torch.randn(shape) * 0.2, group)
            tensors.update({f"{expert}.{name}.qweight": pack_awq(q), f"{expert}.{name}.qzeros": pack_awq(zeros),
                            f"{expert}.{name}.scales": scales})
            dequantised[name] = dequantize(q, zeros, scales, group)
        gate_up.append(torch.cat([dequantised["w1"], dequantised["w3"]]))
        down.append(dequantised["w2"])
    return tensors, torch.stack(gate_up), torch.stack(down)


def _layer(top_k: int = 2) -> FusedMoE:
    return FusedMoE(NUM_EXPERTS, HIDDEN, INTER, MoERouting(top_k=top_k, renormalize=True),
                    quant_method=AwqFusedMoEMethod(GROUP), expert_names=NAMES)


@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_awq_experts_match_the_reference_on_dequantised_weights(top_k, tokens):
    tensors, gate_up, down = _expert_tensors(seed=top_k * 100 + tokens)
    layer = _layer(top_k)
    for name, tensor in tensors.items():
        layer.load_checkpoint_tensor(name, tensor)
    assert layer.missing_checkpoint_tensors() == []
    assert layer.gate_up_proj_qweight.shape == (NUM_EXPERTS, HIDDEN, 2 * INTER // 8)
    layer.quant_method.process_weights_after_loading(layer)  # type: ignore[attr-defined]
    # the packed-int CPU kernel runs the experts wherever it runs the linear layers
    assert (layer.quant_method.cpu_experts is not None) == packed_int_kernel_runs()  # type: ignore[attr-defined]
    torch.manual_seed(tokens)
    x, logits = torch.randn(tokens, HIDDEN), torch.randn(tokens, NUM_EXPERTS)
    weights, ids = select_experts(logits, layer.routing)
    reference = NativeLayerOps().fused_moe(x, gate_up, down, weights, ids)
    torch.testing.assert_close(layer(x, logits), reference, rtol=1e-5, atol=1e-5)


def test_a_missing_or_misshapen_awq_expert_tensor_is_named():
    tensors, _, _ = _expert_tensors()
    layer = _layer()
    for name, tensor in tensors.items():
        if name != "6.w2.qzeros":
            layer.load_checkpoint_tensor(name, tensor)
    assert layer.missing_checkpoint_tensors() == [f"{layer.prefix}.6.w2.qzeros"]
    with pytest.raises(ValueError, match=r"1\.w3\.qweight: checkpoint tensor of shape \(64, 3\)"):
        _layer().load_checkpoint_tensor("1.w3.qweight", tensors["1.w3.qweight"][:, :3])


def test_awq_moe_checkpoint_generates_like_transformers_on_dequantised_weights(tmp_path):
    float_folder = build_moe_model(tmp_path / "float", "mixtral")
    quantized, dequantized = tmp_path / "awq", tmp_path / "dequantized"
    build_awq_pair(float_folder, quantized, dequantized, 32, linear=LINEAR + EXPERTS)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 380) for _ in range(n)] for n in (5, 9, 17, 23, 31, 40, 47, 60)]
    tokens, logprobs = greedy_with_logprobs(quantized, prompts, 12)
    agreement = agreement_with_transformers(dequantized, prompts, tokens, logprobs)
    assert agreement.fraction == 1.0, agreement  # weight-only: the twin's arithmetic up to summation order
    assert agreement.max_logprob_error <= 1e-3, agreement
    assert (tokens, logprobs) != greedy_with_logprobs(float_folder, prompts, 12), "quantization changed nothing"


def _tensor_parallel_layer(group: int, rank: int, world_size: int) -> FusedMoE:
    from tokenmill.layers import ModelBuildContext

    ctx = ModelBuildContext(hf_config=None, prefix="experts", rank=rank, world_size=world_size,
                            params_dtype=torch.float32)
    return FusedMoE(NUM_EXPERTS, HIDDEN, INTER, MoERouting(top_k=2, renormalize=True), ctx=ctx,
                    quant_method=AwqFusedMoEMethod(group), expert_names=NAMES, reduce_results=False)


def test_awq_experts_split_over_two_tensor_parallel_ranks_sum_to_the_dequantised_layer():
    """Tensor parallelism: each rank keeps its half of every expert's intermediate dimension
    (gate/up's packed column words and scales, down's rows and their groups); the two partial
    outputs add up to the float reference on the dequantised weights."""
    group = 8  # 24 intermediate inputs per rank: three whole groups each
    tensors, gate_up, down = _expert_tensors(seed=9, group=group)
    torch.manual_seed(9)
    x, logits = torch.randn(11, HIDDEN), torch.randn(11, NUM_EXPERTS)
    total = torch.zeros(11, HIDDEN)
    for rank in range(2):
        layer = _tensor_parallel_layer(group, rank, 2)
        for name, tensor in tensors.items():
            layer.load_checkpoint_tensor(name, tensor)
        assert layer.missing_checkpoint_tensors() == []
        assert layer.gate_up_proj_qweight.shape == (NUM_EXPERTS, HIDDEN, INTER // 8)
        assert layer.down_proj_qweight.shape == (NUM_EXPERTS, INTER // 2, HIDDEN // 8)
        total += layer(x, logits)
    weights, ids = select_experts(logits, MoERouting(top_k=2, renormalize=True))
    reference = NativeLayerOps().fused_moe(x, gate_up, down, weights, ids)
    torch.testing.assert_close(total, reference, rtol=1e-5, atol=1e-5)


def test_awq_groups_that_would_straddle_two_tensor_parallel_ranks_are_refused_with_the_sizes():
    with pytest.raises(ValueError, match=r"intermediate size of 48 over 2 tensor-parallel ranks is 24 per rank, "
                                         r"not a multiple of AWQ group_size 16"):
        _tensor_parallel_layer(GROUP, 0, 2)
