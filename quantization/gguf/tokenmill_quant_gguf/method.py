"""What the ``gguf`` quantization method is, as the engine sees it."""

from __future__ import annotations

from typing import ClassVar


class GGUFDequantized:
    """GGUF checkpoints, dequantised to the model dtype while they load.

    The loader (:func:`tokenmill_quant_gguf.loader.load_gguf_checkpoint`) turns
    every quantized block back into dense values, so the model runs with plain
    linear layers and needs nothing from this class at run time. Later work keeps
    the blocks quantized in memory and multiplies them with GGUF matmul kernels;
    that is when this class grows layer hooks.
    """

    name: ClassVar[str] = "gguf"
    dequantized_on_load: ClassVar[bool] = True
