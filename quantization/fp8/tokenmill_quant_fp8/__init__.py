"""Registers the ``fp8`` quantization method (no torch at import time).

Checkpoints say ``"quantization_config": {"quant_method": "fp8", ...}`` (the layout
vLLM and transformers' fine-grained FP8 write): each quantized linear layer holds a
float8_e4m3fn ``weight`` and a float32 ``weight_scale`` (one per tensor, or one per
output channel), or, block-wise (``weight_block_size: [128, 128]``), a
``weight_scale_inv`` per 128x128 block; ``activation_scheme: "static"`` adds an
``input_scale``. ``LLM(..., quantization="fp8")`` on a float checkpoint quantizes
its weights at load.
"""

from typing import Any

from tokenmill.plugin_api import QuantMethodSpec, hookimpl

TOKENMILL_PLUGIN_API = 1

FP8_METHOD = QuantMethodSpec(name="fp8", qualname="tokenmill_quant_fp8.config:Fp8Config", checkpoint_aliases=("fp8",))


@hookimpl
def tokenmill_register_quantization_methods(platform: Any) -> list[QuantMethodSpec]:
    """Every platform: where ``torch._scaled_mm`` refuses, a torch reference runs instead."""
    return [FP8_METHOD]
