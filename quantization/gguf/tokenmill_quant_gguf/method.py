"""The ``gguf`` quantization configs, as the engine's model builder sees them."""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from tokenmill.layers import QuantizationConfig
from tokenmill_quant_gguf.embedding_method import GGUFEmbeddingMethod
from tokenmill_quant_gguf.linear_method import GGUFLinearMethod


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

    def get_linear_method(self, layer: nn.Module, prefix: str) -> GGUFLinearMethod:
        return GGUFLinearMethod(dequantize=self.dequantize)

    def get_embedding_method(self, layer: nn.Module, prefix: str) -> GGUFEmbeddingMethod:
        return GGUFEmbeddingMethod(dequantize=self.dequantize)


class GGUFDequantizedConfig(GGUFConfig):
    """``quantization="gguf-dequantized"``: every linear layer dequantised at load to the
    model dtype (the float path: more memory, float matmuls)."""

    name: ClassVar[str] = "gguf-dequantized"
    dequantize: ClassVar[bool] = True
