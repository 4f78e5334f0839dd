"""The ``gguf`` quantization config, as the engine's model builder sees it."""

from __future__ import annotations

from typing import ClassVar

from tokenmill.layers import QuantizationConfig


class GGUFDequantized(QuantizationConfig):
    """GGUF checkpoints, dequantised to the model dtype while they load.

    Chosen for every checkpoint the GGUF loader produced (``Checkpoint.format``
    ``gguf``). The loader (:func:`tokenmill_quant_gguf.loader.load_gguf_checkpoint`)
    turns every quantized block back into dense values, so every linear layer stays
    float: ``get_linear_method`` keeps the base class's answer, None. Later work keeps
    the blocks quantized in memory and multiplies them with GGUF matmul kernels; that
    is when this config returns methods of its own.
    """

    name: ClassVar[str] = "gguf"
    dequantized_on_load: ClassVar[bool] = True
