"""Serialized FP8 experts: a MoE checkpoint (``quant_method: "fp8"``) whose experts store a
float8_e4m3fn ``weight`` and a per-tensor or per-channel ``weight_scale`` each
(tests/fp8_models.py's quantizer) loads into the online FP8 method's layout and runs as it
does: the layer against a token-by-token reference on the dequantised weights; a tiny Mixtral
checkpoint agrees with transformers on its dequantised twin (activations are rounded per
token, so scored as the online FP8 tests score it)."""

from __future__ import annotations

import random

import pytest
import torch
from fp8_models import LINEAR, build_fp8_pair, quantize
from moe_models import build_moe_model
from quant_agreement import agreement_with_transformers, greedy_with_logprobs

from tokenmill.layers import FusedMoE, MoERouting, select_experts
from tokenmill_quant_fp8.kernels import quantize_per_token
from tokenmill_quant_fp8.moe import Fp8SerializedMoEMethod

HIDDEN, INTER, NUM_EXPERTS = 64, 48, 8
NAMES = ("w1", "w3", "w2")  # Mixtral's (gate, up, down)


def _layer(method) -> FusedMoE:
    return FusedMoE(NUM_EXPERTS, HIDDEN, INTER, MoERouting(top_k=2, renormalize=True), quant_method=method,
                    expert_names=NAMES)


def _serialized(scheme: str, seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Per-expert FP8 tensors (``3.w1.weight`` / ``3.w1.weight_scale``) and their dequantised floats."""
    torch.manual_seed(seed)
    tensors, floats = {}, {}
    for expert in range(NUM_EXPERTS):
        for name, shape in (("w1", (INTER, HIDDEN)), ("w3", (INTER, HIDDEN)), ("w2", (HIDDEN, INTER))):
            q, scale_name, scale, full = quantize(torch.randn(shape) * 0.2, scheme, 32)
            tensors[f"{expert}.{name}.weight"], tensors[f"{expert}.{name}.{scale_name}"] = q, scale
            floats[f"{expert}.{name}.weight"] = q.float() * full
    return tensors, floats


def _rounded(x: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] as the method's activations see it: FP8 per token, dequantised."""
    q, scale = quantize_per_token(x)
    return q.float() * scale


def _token_by_token(x, floats, weights, ids, down_parts: int = 1) -> torch.Tensor:
    """Each token through each of its experts on the dequantised weights, the activations
    rounded per token before each matmul: no stacking, no grouping by expert. ``down_parts``:
    the down projection's input rounded in that many parts (a tensor-parallel rank's each)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot, e in enumerate(ids[t].tolist()):
            gate, up = (_rounded(x[t:t + 1]) @ floats[f"{e}.w1.weight"].t(), _rounded(x[t:t + 1]) @ floats[f"{e}.w3.weight"].t())
            hidden = torch.nn.functional.silu(gate) * up
            down = sum(_rounded(part) @ w.t() for part, w in zip(hidden.chunk(down_parts, dim=1),
                                                                 floats[f"{e}.w2.weight"].chunk(down_parts, dim=1),
                                                                 strict=True))
            out[t] += weights[t, slot] * down[0]
    return out


@pytest.mark.parametrize("scheme", ["per-tensor", "per-channel"])
def test_serialized_fp8_experts_match_the_dequantised_reference(scheme):
    tensors, floats = _serialized(scheme)
    layer = _layer(Fp8SerializedMoEMethod())
    for name, tensor in tensors.items():
        layer.load_checkpoint_tensor(name, tensor)
    assert layer.missing_checkpoint_tensors() == []
    layer.quant_method.process_weights_after_loading(layer)  # type: ignore[attr-defined]
    assert layer.gate_up_proj.dtype == layer.down_proj.dtype == torch.float8_e4m3fn
    assert layer.gate_up_proj_scale.shape == (NUM_EXPERTS, 2 * INTER)
    torch.manual_seed(1)
    x, logits = torch.randn(33, HIDDEN), torch.randn(33, NUM_EXPERTS)
    weights, ids = select_experts(logits, layer.routing)
    reference = _token_by_token(x, floats, weights, ids)
    # the same roundings in another order (as tests/test_moe_quantized.py bounds it)
    assert ((layer(x, logits) - reference).norm() / reference.norm()).item() < 2e-3


def test_a_float_expert_or_a_missing_scale_is_refused_by_name():
    tensors, _ = _serialized("per-channel")
    with pytest.raises(ValueError, match=r"2\.w3\.weight: expected float8_e4m3fn"):
        _layer(Fp8SerializedMoEMethod()).load_checkpoint_tensor("2.w3.weight", tensors["2.w3.weight"].float())
    with pytest.raises(ValueError, match=r"4\.w2\.weight_scale: a tensor of shape \(3, 1\)"):
        _layer(Fp8SerializedMoEMethod()).load_checkpoint_tensor("4.w2.weight_scale", tensors["4.w2.weight_scale"][:3])
    layer = _layer(Fp8SerializedMoEMethod())
    for name, tensor in tensors.items():
        if name != "5.w1.weight_scale":
            layer.load_checkpoint_tensor(name, tensor)
    with pytest.raises(ValueError, match="no weight_scale for expert 5's gate_up_proj"):
        layer.quant_method.process_weights_after_loading(layer)  # type: ignore[attr-defined]


@pytest.mark.parametrize("scheme", ["per-tensor", "per-channel"])
def test_fp8_moe_checkpoint_agrees_with_transformers_on_dequantised_weights(scheme, tmp_path):
    float_folder = build_moe_model(tmp_path / "float", "mixtral")
    quantized, dequantized = tmp_path / "fp8", tmp_path / "dequantized"
    build_fp8_pair(float_folder, quantized, dequantized, scheme, linear=(*LINEAR, "w1", "w2", "w3"))
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 380) for _ in range(n)] for n in (5, 9, 17, 23, 31, 40, 47, 60)]
    tokens, logprobs = greedy_with_logprobs(quantized, prompts, 12)
    agreement = agreement_with_transformers(dequantized, prompts, tokens, logprobs)
    assert agreement.fraction >= 0.95, agreement
    assert (tokens, logprobs) != greedy_with_logprobs(float_folder, prompts, 12), "quantization changed nothing"


@pytest.mark.parametrize("scheme", ["per-tensor", "per-channel"])
def test_serialized_fp8_experts_split_over_two_tensor_parallel_ranks(scheme):
    """Each rank holds half of every expert's gate/up rows, with their per-row scales, and half of
    its down columns; the two partial outputs add up to the token-by-token reference whose down
    activations are rounded per token in the ranks' two halves (as each rank rounds its own)."""
    from tokenmill.layers import ModelBuildContext

    tensors, floats = _serialized(scheme, seed=3)
    whole = _layer(Fp8SerializedMoEMethod())
    for name, tensor in tensors.items():
        whole.load_checkpoint_tensor(name, tensor)
    whole.quant_method.process_weights_after_loading(whole)  # type: ignore[attr-defined]
    torch.manual_seed(3)
    x, logits = torch.randn(17, HIDDEN), torch.randn(17, NUM_EXPERTS)
    weights, ids = select_experts(logits, whole.routing)
    expected = _token_by_token(x, floats, weights, ids, down_parts=2)
    total = torch.zeros_like(expected)
    for rank in range(2):
        ctx = ModelBuildContext(hf_config=None, rank=rank, world_size=2, params_dtype=torch.float32)
        layer = FusedMoE(NUM_EXPERTS, HIDDEN, INTER, MoERouting(top_k=2, renormalize=True), ctx=ctx,
                         quant_method=Fp8SerializedMoEMethod(), expert_names=NAMES, reduce_results=False)
        for name, tensor in tensors.items():
            layer.load_checkpoint_tensor(name, tensor)
        layer.quant_method.process_weights_after_loading(layer)  # type: ignore[attr-defined]
        assert layer.gate_up_proj_scale.shape == (NUM_EXPERTS, INTER)
        torch.testing.assert_close(layer.gate_up_proj_scale[:, :INTER // 2],
                                   whole.gate_up_proj_scale[:, rank * INTER // 2:(rank + 1) * INTER // 2])
        total += layer(x, logits)
    assert ((total - expected).norm() / expected.norm()).item() < 2e-3
