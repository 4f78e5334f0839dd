"""The quantization config a model is built with.

A quantization plugin registers a ``QuantMethodSpec`` whose ``qualname`` names a
:class:`QuantizationConfig` subclass. The engine picks one per model (an explicit
``quantization`` option, the checkpoint's ``quantization_config``, or the
single-file format that produced the checkpoint: ``tokenmill.model_loader.quant_config``),
builds it with :meth:`QuantizationConfig.from_config`, and every linear layer then
asks it for its method by prefix. A layer it answers None for stays float.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Self

if TYPE_CHECKING:
    from torch import nn

    from tokenmill.layers.embedding import EmbeddingMethod
    from tokenmill.layers.linear import LinearMethod
    from tokenmill.layers.moe import FusedMoEMethod


class QuantizationConfig:
    """Base of every quantization config; the defaults leave the whole model float."""

    name: ClassVar[str] = "float"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Self:
        """Build from the checkpoint's ``quantization_config`` dict ({} when the
        checkpoint has none, e.g. an explicit option or a single-file format)."""
        return cls()

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        """The method of the linear layer ``layer`` whose checkpoint prefix is
        ``prefix`` (``model.layers.0.mlp.down_proj``); None keeps it float."""
        return None

    def get_embedding_method(self, layer: nn.Module, prefix: str) -> EmbeddingMethod | None:
        """The method of the token embedding ``layer`` at ``prefix``
        (``model.embed_tokens``); None keeps a float table."""
        return None

    def get_moe_method(self, layer: nn.Module, prefix: str) -> FusedMoEMethod | None:
        """The method of the MoE layer ``layer`` (``model.layers.0.mlp.experts``); None
        keeps its experts float."""
        return None
