"""Registers the ``compressed-tensors`` quantization method (no torch at import time).

Checkpoints written by llm-compressor / the ``compressed-tensors`` package say
``"quantization_config": {"quant_method": "compressed-tensors", "format": ...,
"config_groups": {...}, "ignore": [...]}``. The config is parsed by that package;
each config group's scheme is handed to the kernels that run it: INT8 W8A8 to the
``int8`` plugin's, FP8 to the ``fp8`` plugin's, pack-quantized int weights with
float activations (W4A16, W8A16) to the ``gptq`` plugin's dequantise-then-matmul.
"""

from typing import Any

from tokenmill.plugin_api import QuantMethodSpec, hookimpl

TOKENMILL_PLUGIN_API = 1
ACTIVATION_DTYPES = ("float32", "bfloat16", "float16")  # any device: the torch path runs everywhere

COMPRESSED_TENSORS_METHOD = QuantMethodSpec(
    name="compressed-tensors", qualname="tokenmill_quant_compressed_tensors.config:CompressedTensorsConfig",
    checkpoint_aliases=("compressed-tensors", "compressed_tensors"),
    dtypes=ACTIVATION_DTYPES)


@hookimpl
def tokenmill_register_quantization_methods(platform: Any) -> list[QuantMethodSpec]:
    """Every platform: each kernel it dispatches to falls back to a torch path."""
    return [COMPRESSED_TENSORS_METHOD]
