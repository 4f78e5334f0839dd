"""INT8 W8A8's activation schemes against the ``compressed-tensors`` package's own rounding.

Asymmetric per-token and static per-tensor (symmetric or with a zero point) inputs must
round exactly as the checkpoint's tool defines them: the package's
``compute_dynamic_scales_and_zp`` / ``calculate_qparams`` and ``quantize`` /
``fake_quantize`` are the reference. A W8A8 layer (merged, with a bias, loaded shard by
shard as a model does) then equals the float64 product of the package's rounded input and
the dequantised weight, up to float32 rounding of the scales (1e-5 relative): the
zero-point correction (``zero * rowsum(W)``) is exact integer arithmetic.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import fake_quantize, quantize
from compressed_tensors.quantization.utils.helpers import calculate_qparams, compute_dynamic_scales_and_zp
from w8a8_models import W8A8_CONFIG, quantize_per_channel

from tokenmill.layers import MergedLinear, ModelBuildContext
from tokenmill.layers.linear import load_weight, process_weights_after_loading
from tokenmill_quant_int8.activations import (
    ActivationScheme,
    merge_static_shards,
    quantize_input,
    quantize_per_token_asymmetric,
)
from tokenmill_quant_int8.config import Int8W8A8Config

TOKEN_ASYMMETRIC = {"strategy": "token", "dynamic": True, "symmetric": False}
TENSOR_SYMMETRIC = {"strategy": "tensor", "dynamic": False, "symmetric": True}
TENSOR_ASYMMETRIC = {"strategy": "tensor", "dynamic": False, "symmetric": False}
SCHEMES = {"token-asymmetric": TOKEN_ASYMMETRIC, "tensor-symmetric": TENSOR_SYMMETRIC,
           "tensor-asymmetric": TENSOR_ASYMMETRIC}


def input_args(**fields: Any) -> QuantizationArgs:
    return QuantizationArgs.model_validate({"num_bits": 8, "type": "int", **fields})


def skewed_rows(m: int, k: int, seed: int) -> torch.Tensor:
    """Rows of any sign mix: shifted so some are all positive or all negative, one all zero."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator) * 3 + torch.randn(m, 1, generator=generator) * 4
    if m > 1:
        x[1] = 0.0
    return x


@pytest.mark.parametrize("m", [1, 7, 64])
@pytest.mark.parametrize("k", [50, 200])
def test_asymmetric_per_token_rounding_is_the_packages(m: int, k: int) -> None:
    x = skewed_rows(m, k, seed=m * k)
    args = input_args(**TOKEN_ASYMMETRIC)
    scale, zero = compute_dynamic_scales_and_zp(x.unsqueeze(0), args, torch.nn.Linear(1, 1))
    ours = quantize_per_token_asymmetric(x)
    assert ours.zero is not None
    # An all-zero row has no range (the package's zero point is then a NaN cast to int8): any
    # scale and zero point do, as long as every value comes back 0.
    nonzero = x.abs().amax(dim=1) > 0
    assert torch.equal(ours.scale[nonzero], scale[0][nonzero])
    assert torch.equal(ours.zero[nonzero], zero[0][nonzero].to(torch.int32))
    assert torch.equal(ours.q[nonzero], quantize(x.unsqueeze(0), scale, zero, args, dtype=torch.int8)[0][nonzero])
    assert not (ours.q.int() - ours.zero)[~nonzero].any()


@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "asymmetric"])
def test_static_rounding_is_the_packages_and_saturates_beyond_the_calibrated_range(symmetric: bool) -> None:
    calibration = skewed_rows(16, 64, seed=1)
    args = input_args(**(TENSOR_SYMMETRIC if symmetric else TENSOR_ASYMMETRIC))
    scale, zero = calculate_qparams(calibration.min().reshape(1), calibration.max().reshape(1), args)
    x = skewed_rows(7, 64, seed=2) * 2  # partly outside the calibrated range
    ours = quantize_input(x, ActivationScheme(symmetric=symmetric, static=True), scale, None if symmetric else zero)
    assert torch.equal(ours.q, quantize(x, scale, zero, args, dtype=torch.int8))
    assert int(ours.q.min()) == -128 and int(ours.q.max()) == 127


def w8a8_config(inputs: dict[str, Any]) -> Int8W8A8Config:
    config = copy.deepcopy({**W8A8_CONFIG, "quant_method": "int8_w8a8"})
    config["config_groups"]["group_0"]["input_activations"].update(inputs)
    return Int8W8A8Config.from_config(config)


def w8a8_layer(inputs: dict[str, Any], weights: list[torch.Tensor], bias: torch.Tensor,
               static: dict[str, list[torch.Tensor]]) -> MergedLinear:
    """A merged W8A8 layer, its shards loaded one by one (``static``: per-shard input tensors)."""
    ctx = ModelBuildContext(hf_config=None, quant_config=w8a8_config(inputs), prefix="model.layers.0.mlp.gate_up_proj",
                            params_dtype=torch.float32)
    layer = MergedLinear(weights[0].shape[1], [w.shape[0] for w in weights], bias=True, ctx=ctx)
    params = dict(layer.named_parameters())
    for shard, weight in enumerate(weights):
        q, scale = quantize_per_channel(weight)
        load_weight(params["weight"], q, shard)
        load_weight(params["weight_scale"], scale, shard)
        for name, values in static.items():
            load_weight(params[name], values[shard], shard)
    load_weight(params["bias"], bias)
    process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("tokens", [1, 7])
def test_a_merged_layer_is_the_product_of_the_packages_rounded_input(scheme: str, tokens: int) -> None:
    generator = torch.Generator().manual_seed(tokens)
    weights = [torch.randn(rows, 72, generator=generator) * 0.1 for rows in (40, 24)]
    bias = torch.randn(64, generator=generator)
    x = skewed_rows(tokens, 72, seed=tokens + 1)
    args = input_args(**SCHEMES[scheme])
    static: dict[str, list[torch.Tensor]] = {}
    if not args.dynamic:  # calibrated on other inputs: the same parameters for both shards, as the tool gives
        calibration = skewed_rows(16, 72, seed=0)
        scale, zero = calculate_qparams(calibration.min().reshape(1), calibration.max().reshape(1), args)
        static["input_scale"] = [scale, scale]
        if not args.symmetric:
            static["input_zero_point"] = [zero, zero]
    else:
        scale, zero = compute_dynamic_scales_and_zp(x.unsqueeze(0), args, torch.nn.Linear(1, 1))
        scale, zero = scale[0], zero[0]
    layer = w8a8_layer(SCHEMES[scheme], weights, bias, static)
    rounded = fake_quantize(x, scale, zero, args).double()
    dequantised = torch.cat([q.double() * s.double() for q, s in map(quantize_per_channel, weights)])
    expected = rounded @ dequantised.t() + bias.double()
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def test_merged_shards_with_different_static_ranges_take_one_covering_them_all() -> None:
    args = input_args(**TENSOR_ASYMMETRIC)
    ranges = [(-1.0, 3.0), (-2.5, 0.5)]
    params = [calculate_qparams(torch.tensor([lo]), torch.tensor([hi]), args) for lo, hi in ranges]
    scale, zero = merge_static_shards(torch.cat([s for s, _ in params]), torch.cat([z for _, z in params]).int())
    assert zero is not None
    low, high = float((-128 - zero) * scale), float((127 - zero) * scale)
    assert low <= -2.5 + float(scale) and high >= 3.0 - float(scale)
    same = merge_static_shards(torch.cat([params[0][0]] * 2), torch.cat([params[0][1]] * 2).int())
    assert same[0].item() == params[0][0].item() and same[1] is not None and same[1].item() == params[0][1].item()
    symmetric, none = merge_static_shards(torch.tensor([0.02, 0.05, 0.03]), None)
    assert symmetric.item() == pytest.approx(0.05) and none is None


def test_a_static_scheme_without_its_input_scale_is_refused_at_load() -> None:
    with pytest.raises(ValueError, match=r"gate_up_proj: the checkpoint has no input_scale for shards \[1\]"):
        w8a8_layer(TENSOR_SYMMETRIC, [torch.randn(8, 32), torch.randn(8, 32)], torch.zeros(16),
                   {"input_scale": [torch.tensor([0.1]), torch.tensor([float("nan")])]})


@pytest.mark.parametrize(("inputs", "message"), [
    ({"strategy": "token", "dynamic": False}, "strategy 'token' with dynamic False"),
    ({"strategy": "tensor", "dynamic": True}, "strategy 'tensor' with dynamic True"),
    ({"strategy": "group", "group_size": 32}, "group_size 32"),
    ({"num_bits": 4}, "num_bits is 4"),
])
def test_activation_schemes_no_kernel_runs_are_refused_naming_the_field(inputs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=f"input_activations.*{message}"):
        w8a8_config(inputs)
