"""Building blocks shared by model, quantization and attention plugins."""

from tokenmill.attention.encoder import EncoderBatch, bidirectional_attention
from tokenmill.layers.attention import Attention
from tokenmill.layers.aux_hidden_states import AuxHiddenStateRecorder
from tokenmill.layers.build_context import ModelBuildContext
from tokenmill.layers.communicator import Communicator
from tokenmill.layers.embedding import EmbeddingMethod, VocabEmbedding
from tokenmill.layers.expert_parallel import ExpertPlacement
from tokenmill.layers.expert_replicas import ReplicatedExperts
from tokenmill.layers.latent_attention import LatentAttention
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
from tokenmill.layers.merged_loading import QKV_GATE_UP_SHARDS, load_into_merged
from tokenmill.layers.moe import (
    ExpertShardLoader,
    FusedMoE,
    FusedMoEMethod,
    UnquantizedFusedMoEMethod,
    check_experts_loaded,
    expert_load_by_layer,
    held_checkpoint_tensors,
    load_imbalance,
)
from tokenmill.layers.moe_quantization import (
    EXPERT_WEIGHTS,
    OnlineQuantizedMoEMethod,
    QuantizedFusedMoEOps,
    apply_experts_one_by_one,
    expert_tensor_name,
    missing_expert_tensors,
    quantize_experts,
)
from tokenmill.layers.moe_routing import MoERouting, select_experts
from tokenmill.layers.mrope import MRopeItem, MRotaryEmbedding, mrope_prompt_positions
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.online_quantization import add_float_weight, quantize_loaded_weight
from tokenmill.layers.ops import LayerOps, NativeLayerOps, layer_ops, register_layer_ops
from tokenmill.layers.packed_int import (
    SUPPORTED_BITS,
    dequantize_grouped,
    dequantized_linear,
    gptq_dequantize,
    pack_columns,
    pack_rows,
    unpack_columns,
    unpack_rows,
    values_per_word,
)
from tokenmill.layers.packed_int_cpu import (
    CpuPackedInt,
    cpu_packed_int_experts,
    cpu_packed_int_linear,
    cpu_packed_int_weights,
    pack_for_cpu,
    packed_int_integer_decode,
    packed_int_kernel_isa,
    packed_int_kernel_runs,
)
from tokenmill.layers.pipeline import PipelineStage, left_out_prefixes, make_layers, on_stage
from tokenmill.layers.quantization import QuantizationConfig
from tokenmill.layers.rotary import RotaryEmbedding, get_rotary_embedding, rope_inverse_frequencies
from tokenmill.layers.self_attention import RotarySelfAttention, attention_head_size, sliding_window_of_layer

__all__ = [
    # packed int weights (tokenmill.layers.packed_int)
    "SUPPORTED_BITS",
    "dequantize_grouped",
    "dequantized_linear",
    "gptq_dequantize",
    "pack_columns",
    "pack_rows",
    "unpack_columns",
    "unpack_rows",
    "values_per_word",
    # their CPU kernel (tokenmill.layers.packed_int_cpu)
    "CpuPackedInt",
    "cpu_packed_int_experts",
    "cpu_packed_int_linear",
    "cpu_packed_int_weights",
    "pack_for_cpu",
    "packed_int_integer_decode",
    "packed_int_kernel_isa",
    "packed_int_kernel_runs",
    "Attention",
    "AuxHiddenStateRecorder",
    "Communicator",
    "EmbeddingMethod",
    "EncoderBatch",
    "ExpertPlacement",
    "ExpertShardLoader",
    "LatentAttention",
    "FusedMoE",
    "FusedMoEMethod",
    "LayerOps",
    "Linear",
    "LinearMethod",
    "MergedLinear",
    "MoERouting",
    "ModelBuildContext",
    "NativeLayerOps",
    "OnlineQuantizedMoEMethod",
    "QuantizedFusedMoEOps",
    "OutputShardLoader",
    "ParallelLMHead",
    "PipelineStage",
    "QuantizationConfig",
    "RMSNorm",
    "ReplicatedExperts",
    "RotaryEmbedding",
    "UnquantizedFusedMoEMethod",
    "UnquantizedLinearMethod",
    "VocabEmbedding",
    "WeightLoader",
    "add_float_weight",
    "bidirectional_attention",
    "check_experts_loaded",
    "default_weight_loader",
    "expert_load_by_layer",
    "held_checkpoint_tensors",
    "get_rotary_embedding",
    "RotarySelfAttention",
    "attention_head_size",
    "sliding_window_of_layer",
    "layer_ops",
    "EXPERT_WEIGHTS",
    "apply_experts_one_by_one",
    "expert_tensor_name",
    "missing_expert_tensors",
    "load_imbalance",
    "left_out_prefixes",
    "load_weight",
    "load_into_merged",
    "QKV_GATE_UP_SHARDS",
    "make_layers",
    "on_stage",
    "quantize_experts",
    "quantize_loaded_weight",
    "register_layer_ops",
    "rope_inverse_frequencies",
    "select_experts",
    # M-RoPE (tokenmill.layers.mrope)
    "MRopeItem",
    "MRotaryEmbedding",
    "mrope_prompt_positions",
]
