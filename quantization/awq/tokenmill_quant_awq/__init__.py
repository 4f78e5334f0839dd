"""Registers the ``awq`` quantization method (no torch at import time).

Checkpoints say ``"quantization_config": {"quant_method": "awq", "bits": 4,
"group_size": 128, "zero_point": true, "version": "gemm"}`` (what AutoAWQ writes);
each quantized linear layer holds ``qweight`` (int32 ``[K, N / 8]``: 4-bit values
packed along the *output* dimension in AWQ's interleaved order), ``qzeros`` (int32
``[K / group_size, N / 8]``, the same order) and ``scales`` (float16
``[K / group_size, N]``).
"""

from typing import Any

from tokenmill.plugin_api import QuantMethodSpec, hookimpl

TOKENMILL_PLUGIN_API = 1
ACTIVATION_DTYPES = ("float32", "bfloat16", "float16")  # any device: the torch path runs everywhere

AWQ_METHOD = QuantMethodSpec(name="awq", qualname="tokenmill_quant_awq.config:AwqConfig", checkpoint_aliases=("awq",),
                             dtypes=ACTIVATION_DTYPES)


@hookimpl
def tokenmill_register_quantization_methods(platform: Any) -> list[QuantMethodSpec]:
    """Every platform: the dequantise-then-matmul path is plain torch."""
    return [AWQ_METHOD]
