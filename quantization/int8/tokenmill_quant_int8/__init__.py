"""Registers the ``int8`` (W8A8) quantization method (no torch at import time).

It runs compressed-tensors' ``int-quantized`` checkpoints (one config group of
8-bit symmetric int weights per output channel and int8 activations, symmetric or
asymmetric, dynamic per token or static per tensor, as llm-compressor's W8A8 recipes
write them): ``quant_method:
"compressed-tensors"`` is read by the ``compressed-tensors`` plugin, which hands
such a group's layers to this method; ``quant_method: "int8_w8a8"`` comes here
directly. Each quantized linear layer holds an int8 ``weight`` and a
``weight_scale`` ``[out, 1]``. ``LLM(..., quantization="int8")`` on a float checkpoint
quantizes its weights at load.
"""

from typing import Any

from tokenmill.plugin_api import QuantMethodSpec, hookimpl

TOKENMILL_PLUGIN_API = 1

INT8_METHOD = QuantMethodSpec(name="int8", qualname="tokenmill_quant_int8.config:Int8W8A8Config",
                              checkpoint_aliases=("int8_w8a8",))


@hookimpl
def tokenmill_register_quantization_methods(platform: Any) -> list[QuantMethodSpec]:
    """Every platform: where ``torch._int_mm`` refuses a shape, a torch reference runs instead."""
    return [INT8_METHOD]
