"""The int8 (W8A8) method through the conformance kit: an int8 ``weight`` + ``weight_scale``
``[out, 1]`` layer (``quant_method: "int8_w8a8"``, tests/w8a8_models.py's quantizer)
against its dequantised weight.

Tolerance: the activations are rounded to int8 per token (a step of ``max|x_row| / 127``,
about 0.7% of a standard normal row's max), an error of a few tenths of a percent of the
output (measured: 0.003-0.004); 0.01.
"""

from __future__ import annotations

from typing import Any, ClassVar

from w8a8_models import W8A8_CONFIG, quantize_per_channel

from tokenmill.testing.quantization import QuantizationConformance, QuantizedWeights, random_weight


class TestInt8Conformance(QuantizationConformance):
    method = "int8_w8a8"
    # llm-compressor's W8A8 group, under the alias that comes to this plugin directly
    quantization_config: ClassVar[dict[str, Any]] = {**W8A8_CONFIG, "quant_method": "int8_w8a8"}
    relative_tolerance = 0.01
    activation_dtypes = ("float32", "bfloat16")

    def make_weights(self, out_features: int, in_features: int, seed: int) -> QuantizedWeights:
        q, scale = quantize_per_channel(random_weight(out_features, in_features, seed))
        return QuantizedWeights({"weight": q, "weight_scale": scale}, q.float() * scale)
