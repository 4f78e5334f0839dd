"""The awq method through the conformance kit: AutoAWQ's GEMM layout (``qweight``/``qzeros``
int32 in its interleaved nibble order, ``scales`` float16; tests/awq_models.py's packer)
against the dequantised weight. Weight-only: the default tolerance (accumulation order)."""

from __future__ import annotations

from awq_models import awq_config, dequantize, pack_awq, quantize

from tokenmill.testing.quantization import QuantizationConformance, QuantizedWeights, random_weight

GROUP = 32


class TestAwqConformance(QuantizationConformance):
    method = "awq"
    quantization_config = awq_config(GROUP)
    activation_dtypes = ("float32", "bfloat16")

    def make_weights(self, out_features: int, in_features: int, seed: int) -> QuantizedWeights:
        q, zeros, scales = quantize(random_weight(out_features, in_features, seed), GROUP)
        return QuantizedWeights({"qweight": pack_awq(q), "qzeros": pack_awq(zeros), "scales": scales},
                                dequantize(q, zeros, scales, GROUP))
