"""Building blocks shared by model, quantization and attention plugins."""

from tokenmill.layers.attention import Attention
from tokenmill.layers.linear import Linear, LinearMethod, MergedLinear, UnquantizedLinearMethod
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.ops import LayerOps, NativeLayerOps, layer_ops, register_layer_ops
from tokenmill.layers.rotary import RotaryEmbedding, rope_inverse_frequencies

__all__ = [
    "Attention",
    "LayerOps",
    "Linear",
    "LinearMethod",
    "MergedLinear",
    "NativeLayerOps",
    "RMSNorm",
    "RotaryEmbedding",
    "UnquantizedLinearMethod",
    "layer_ops",
    "register_layer_ops",
    "rope_inverse_frequencies",
]
