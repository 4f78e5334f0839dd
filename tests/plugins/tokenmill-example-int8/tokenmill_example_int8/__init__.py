"""Registers the ``example-int8`` quantization method (no torch at import time).

A checkpoint whose ``config.json`` says ``"quantization_config": {"quant_method":
"example_int8"}`` stores each quantized linear layer as ``<prefix>.qweight`` (int8,
``[out, in]``) and ``<prefix>.scales`` (float, ``[out]``): ``W = qweight * scales[:, None]``.
"""

from typing import Any

from tokenmill.plugin_api import QuantMethodSpec, hookimpl

TOKENMILL_PLUGIN_API = 1

CHECKPOINT_ALIAS = "example_int8"


@hookimpl
def tokenmill_register_quantization_methods(platform: Any) -> list[QuantMethodSpec]:
    """Plain torch ops, so every platform runs it."""
    return [QuantMethodSpec(name="example-int8", qualname="tokenmill_example_int8.method:Int8WeightOnlyConfig",
                            checkpoint_aliases=(CHECKPOINT_ALIAS,))]
