"""The compressed-tensors method through the conformance kit: each format's tensors written
by the ``compressed-tensors`` package's own compressor (tests/compressed_tensors_models.py),
against the same package's decompressed weight. Weight-only schemes: the default tolerance;
W8A8 and FP8 round the activations too (per token, int8 and e4m3: the int8 and fp8 kits'
bounds)."""

from __future__ import annotations

from typing import Any

from compressed_tensors_models import compress_weight, preset, quantization_config

from tokenmill.testing.quantization import QuantizationConformance, QuantizedWeights, random_weight


class _CompressedTensorsConformance(QuantizationConformance):
    method = "compressed-tensors"
    scheme: Any = None
    fmt = "pack-quantized"
    activation_dtypes = ("float32", "bfloat16")

    def make_weights(self, out_features: int, in_features: int, seed: int) -> QuantizedWeights:
        tensors, restored = compress_weight(random_weight(out_features, in_features, seed), self.scheme, self.fmt)
        return QuantizedWeights(tensors, restored)


def _conformance(name: str, fmt: str, tolerance: float, **weights: Any) -> type[_CompressedTensorsConformance]:
    scheme = preset(name, **weights)
    return type("Conformance", (_CompressedTensorsConformance,), {
        "scheme": scheme, "fmt": fmt, "quantization_config": quantization_config(scheme, fmt),
        "relative_tolerance": tolerance})


TestW4A16GroupConformance = _conformance("W4A16", "pack-quantized", 1e-5, group_size=32)
TestW4A16AsymChannelConformance = _conformance("W4A16_ASYM", "pack-quantized", 1e-5, strategy="channel",
                                               group_size=None)
TestW8A8Conformance = _conformance("W8A8", "int-quantized", 0.01)
TestFp8DynamicConformance = _conformance("FP8_DYNAMIC", "float-quantized", 0.03)
