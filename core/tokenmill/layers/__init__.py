"""Building blocks shared by model, quantization and attention plugins."""

from tokenmill.layers.attention import Attention
from tokenmill.layers.linear import Linear, LinearMethod, MergedLinear, UnquantizedLinearMethod
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding, rope_inverse_frequencies

__all__ = [
    "Attention",
    "Linear",
    "LinearMethod",
    "MergedLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "UnquantizedLinearMethod",
    "rope_inverse_frequencies",
]
