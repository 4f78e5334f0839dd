"""Building blocks shared by model, quantization and attention plugins."""

from tokenmill.layers.attention import Attention
from tokenmill.layers.build_context import ModelBuildContext
from tokenmill.layers.communicator import Communicator
from tokenmill.layers.embedding import VocabEmbedding
from tokenmill.layers.linear import (
    Linear,
    LinearMethod,
    MergedLinear,
    OutputShardLoader,
    UnquantizedLinearMethod,
    WeightLoader,
    default_weight_loader,
    load_weight,
)
from tokenmill.layers.lm_head import ParallelLMHead
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.ops import LayerOps, NativeLayerOps, layer_ops, register_layer_ops
from tokenmill.layers.pipeline import PipelineStage, left_out_prefixes, make_layers, on_stage
from tokenmill.layers.quantization import QuantizationConfig
from tokenmill.layers.rotary import RotaryEmbedding, get_rotary_embedding, rope_inverse_frequencies

__all__ = [
    "Attention",
    "Communicator",
    "LayerOps",
    "Linear",
    "LinearMethod",
    "MergedLinear",
    "ModelBuildContext",
    "NativeLayerOps",
    "OutputShardLoader",
    "ParallelLMHead",
    "PipelineStage",
    "QuantizationConfig",
    "RMSNorm",
    "RotaryEmbedding",
    "UnquantizedLinearMethod",
    "VocabEmbedding",
    "WeightLoader",
    "default_weight_loader",
    "get_rotary_embedding",
    "layer_ops",
    "left_out_prefixes",
    "load_weight",
    "make_layers",
    "on_stage",
    "register_layer_ops",
    "rope_inverse_frequencies",
]
