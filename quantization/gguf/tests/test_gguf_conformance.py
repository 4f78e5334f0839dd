"""The gguf method through the conformance kit: a layer's ``qweight_type`` and block rows
(``qweight``), packed by the ``gguf`` package (llama.cpp's packing), against the package's
own dequantisation, for each type the layer keeps quantized. A weight-only method: the
default tolerance (accumulation order)."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from tokenmill.testing.quantization import QuantizationConformance, QuantizedWeights, random_weight


class _GgufConformance(QuantizationConformance):
    method = "gguf"
    quantization_config: ClassVar[dict[str, Any]] = {}  # a single-file format: no quantization_config
    qtype = GGMLQuantizationType.Q8_0
    activation_dtypes = ("float32", "bfloat16")

    def make_weights(self, out_features: int, in_features: int, seed: int) -> QuantizedWeights:
        values = random_weight(out_features, in_features, seed).numpy()
        rows = np.ascontiguousarray(quantize(values, self.qtype))
        restored = dequantize(rows, self.qtype).reshape(out_features, in_features)
        return QuantizedWeights({"qweight_type": torch.tensor(int(self.qtype)), "qweight": torch.from_numpy(rows)},
                                torch.from_numpy(np.array(restored, dtype=np.float32)))


class TestGgufQ8_0Conformance(_GgufConformance):
    qtype = GGMLQuantizationType.Q8_0


class TestGgufQ4_0Conformance(_GgufConformance):
    qtype = GGMLQuantizationType.Q4_0


class TestGgufQ4_1Conformance(_GgufConformance):
    qtype = GGMLQuantizationType.Q4_1
