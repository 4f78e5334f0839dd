"""The ``gguf`` quantization configs, as the engine's model builder sees them."""

from __future__ import annotations

import os
from typing import ClassVar, cast, get_args

from torch import nn

from tokenmill.layers import QuantizationConfig
from tokenmill_quant_gguf.embedding_method import GGUFEmbeddingMethod
from tokenmill_quant_gguf.kernels import Activations
from tokenmill_quant_gguf.linear_method import GGUFLinearMethod

ACTIVATIONS_VARIABLE = "TOKENMILL_GGUF_ACTIVATIONS"


class GGUFConfig(QuantizationConfig):
    """GGUF checkpoints, their linear layers kept in the file's quantized blocks.

    Chosen for every checkpoint the GGUF loader produced (``Checkpoint.format``
    ``gguf``). Every linear layer gets a :class:`GGUFLinearMethod` (the loader gives
    every linear weight as blocks), and the token embedding a
    :class:`GGUFEmbeddingMethod` (a tied lm_head multiplies by its blocks); the norms
    come dequantised. Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K weights stay
    quantized; other types are dequantised at load.
    """

    name: ClassVar[str] = "gguf"
    dequantize: ClassVar[bool] = False

    def __init__(self, activations: Activations | None = None) -> None:
        # How the layers' inputs meet the blocks (tokenmill_quant_gguf.kernels): by default ("auto")
        # the faster of three 8-bit planes through integer dot products and the float path, by block
        # type, both within float tolerance of the float32 product; $TOKENMILL_GGUF_ACTIVATIONS=q8
        # gives llama.cpp's one plane, float32 the float path everywhere.
        self.activations = activations or activations_from_environment()

    def get_linear_method(self, layer: nn.Module, prefix: str) -> GGUFLinearMethod:
        return GGUFLinearMethod(dequantize=self.dequantize, activations=self.activations)

    def get_embedding_method(self, layer: nn.Module, prefix: str) -> GGUFEmbeddingMethod:
        return GGUFEmbeddingMethod(dequantize=self.dequantize, activations=self.activations)


class GGUFDequantizedConfig(GGUFConfig):
    """``quantization="gguf-dequantized"``: every linear layer dequantised at load to the
    model dtype (the float path: more memory, float matmuls)."""

    name: ClassVar[str] = "gguf-dequantized"
    dequantize: ClassVar[bool] = True


def activations_from_environment() -> Activations:
    """``$TOKENMILL_GGUF_ACTIVATIONS`` (``auto``, ``float32``, ``q8``, ``q8x2`` or ``q8x3``), ``auto`` where unset."""
    value = os.environ.get(ACTIVATIONS_VARIABLE, "auto")
    if value not in get_args(Activations):
        raise ValueError(f"${ACTIVATIONS_VARIABLE} must be one of {', '.join(get_args(Activations))}, not {value!r}")
    return cast(Activations, value)
