"""The fp8 method through the conformance kit: a linear layer loaded from each on-disk
scheme's tensors (tests/fp8_models.py's quantizer) against its dequantised weight.

Tolerance: the activations are rounded to e4m3 (per token, or at the static scale)
before the matmul, 3 mantissa bits: about 2.7% RMS per element, which a sum over the
inputs keeps at about that relative size in the output (measured: 0.016-0.020); 0.03.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from fp8_models import FP8_MAX, quantize

from tokenmill.testing.quantization import QuantizationConformance, QuantizedWeights, random_weight

BLOCK = 32
FP8_ACTIVATION_TOLERANCE = 0.03


class _Fp8Conformance(QuantizationConformance):
    method = "fp8"
    scheme = "per-channel"
    relative_tolerance = FP8_ACTIVATION_TOLERANCE
    activation_dtypes = ("float32", "bfloat16")

    def make_weights(self, out_features: int, in_features: int, seed: int) -> QuantizedWeights:
        q, scale_name, scale, full = quantize(random_weight(out_features, in_features, seed), self.scheme, BLOCK)
        tensors = {"weight": q, scale_name: scale}
        if self.scheme == "static":  # the kit's activations are standard normal: |x| < 5 in practice
            tensors["input_scale"] = torch.tensor(5.0 / FP8_MAX)
        return QuantizedWeights(tensors, q.float() * full)


class TestFp8PerTensorConformance(_Fp8Conformance):
    quantization_config: ClassVar[dict[str, Any]] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    scheme = "per-tensor"


class TestFp8PerChannelConformance(_Fp8Conformance):
    quantization_config: ClassVar[dict[str, Any]] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    scheme = "per-channel"


class TestFp8StaticConformance(_Fp8Conformance):
    quantization_config: ClassVar[dict[str, Any]] = {"quant_method": "fp8", "activation_scheme": "static"}
    scheme = "static"


class TestFp8BlockConformance(_Fp8Conformance):
    quantization_config: ClassVar[dict[str, Any]] = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}
    scheme = "block"


class _WrongScaleFp8(_Fp8Conformance):
    """A factory whose dequantised weight is 5% off the tensors it writes."""

    quantization_config: ClassVar[dict[str, Any]] = {"quant_method": "fp8", "activation_scheme": "dynamic"}

    def make_weights(self, out_features: int, in_features: int, seed: int) -> QuantizedWeights:
        right = super().make_weights(out_features, in_features, seed)
        return QuantizedWeights(right.tensors, right.dequantized * 1.05)


def test_the_kit_fails_a_weight_that_is_not_what_the_tensors_hold():
    import pytest

    with pytest.raises(AssertionError, match="relative error"):
        _WrongScaleFp8().test_linear_matches_dequantized_weight((64, 96), "float32")
