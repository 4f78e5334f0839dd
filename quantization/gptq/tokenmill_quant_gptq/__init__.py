"""Registers the ``gptq`` quantization method (no torch at import time).

Checkpoints say ``"quantization_config": {"quant_method": "gptq", "bits": 4,
"group_size": 128, "desc_act": false, "sym": true, ...}`` (what AutoGPTQ and
GPTQModel write); each quantized linear layer holds ``qweight`` (int32, ``bits``-wide
values packed along the input dimension), ``qzeros`` (int32, packed along the
output dimension), ``scales`` (one per group and output channel) and ``g_idx``
(the group of every input channel; with ``desc_act`` it is a permutation's).
"""

from typing import Any

from tokenmill.plugin_api import QuantMethodSpec, hookimpl

TOKENMILL_PLUGIN_API = 1
ACTIVATION_DTYPES = ("float32", "bfloat16", "float16")  # any device: the torch path runs everywhere

GPTQ_METHOD = QuantMethodSpec(name="gptq", qualname="tokenmill_quant_gptq.config:GptqConfig",
                              checkpoint_aliases=("gptq",), dtypes=ACTIVATION_DTYPES)


@hookimpl
def tokenmill_register_quantization_methods(platform: Any) -> list[QuantMethodSpec]:
    """Every platform: the dequantise-then-matmul path is plain torch."""
    return [GPTQ_METHOD]
