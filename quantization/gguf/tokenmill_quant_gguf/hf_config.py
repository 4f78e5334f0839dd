"""A transformers config and generation defaults built from GGUF metadata.

We map the llama-family keys ourselves instead of calling
``AutoConfig.from_pretrained(gguf_file=...)``: that re-parses the whole file
(seconds, for a 50k vocabulary), leaves ``architectures`` unset and ignores the
head width of Qwen3, whose heads are wider than ``hidden_size / num_heads``.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from tokenmill_quant_gguf.architectures import GGUFArchitecture
from tokenmill_quant_gguf.metadata import GGUFMetadata

logger = logging.getLogger(__name__)

EMBEDDING_TENSOR = "token_embd.weight"
OUTPUT_TENSOR = "output.weight"
ROPE_FREQS_TENSOR = "rope_freqs.weight"

# Token ids the config carries (transformers attribute -> GGUF key).
CONFIG_TOKEN_IDS = {
    "bos_token_id": "tokenizer.ggml.bos_token_id",
    "eos_token_id": "tokenizer.ggml.eos_token_id",
    "pad_token_id": "tokenizer.ggml.padding_token_id",
}
# llama.cpp stops generating on any of these "end of generation" tokens.
END_OF_GENERATION_KEYS = (
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
)


def build_hf_config(metadata: GGUFMetadata, arch: GGUFArchitecture) -> PretrainedConfig:
    """The transformers config for ``arch``, from the file's hyperparameters and tensor shapes."""
    num_heads = int(metadata.require_arch_value("attention.head_count"))
    hidden_size = int(metadata.require_arch_value("embedding_length"))
    kwargs: dict[str, Any] = {
        "architectures": [arch.hf_architecture],
        "vocab_size": _vocab_size(metadata),
        "hidden_size": hidden_size,
        "intermediate_size": int(metadata.require_arch_value("feed_forward_length")),
        "num_hidden_layers": int(metadata.require_arch_value("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(metadata.arch_value("attention.head_count_kv", num_heads)),
        "head_dim": _head_dim(metadata, hidden_size, num_heads),
        "max_position_embeddings": int(metadata.require_arch_value("context_length")),
        "rms_norm_eps": float(metadata.require_arch_value("attention.layer_norm_rms_epsilon")),
        "rope_parameters": rope_parameters(metadata),
        # llama.cpp writes no output tensor when the LM head reuses the embedding.
        "tie_word_embeddings": OUTPUT_TENSOR not in metadata.tensor_shapes,
    }
    kwargs.update(_token_ids(metadata))
    kwargs.update(_arch_specific(metadata, arch))
    if ROPE_FREQS_TENSOR in metadata.tensor_shapes:
        # Llama 3.1-style rope scaling is stored as per-frequency factors whose
        # parameters the file does not keep; transformers drops it too.
        logger.warning(
            "%s: llama3 rope scaling (rope_freqs) is not reconstructed; contexts beyond the "
            "original training length will degrade",
            metadata.get("general.name", "GGUF model"),
        )
    return AutoConfig.for_model(arch.model_type, **kwargs)


def rope_parameters(metadata: GGUFMetadata) -> dict[str, Any]:
    """transformers ``rope_parameters`` from llama.cpp's ``rope.*`` keys."""
    params: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(metadata.arch_value("rope.freq_base", 10000.0)),
    }
    scaling = str(metadata.arch_value("rope.scaling.type", "none"))
    factor = metadata.arch_value("rope.scaling.factor", metadata.arch_value("rope.scale_linear"))
    if scaling == "none" and factor is not None and float(factor) != 1.0:
        scaling = "linear"  # older files only wrote rope.scale_linear
    if scaling == "none":
        return params
    if scaling not in ("linear", "yarn"):
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported")
    params.update(rope_type=scaling, factor=float(factor if factor is not None else 1.0))
    original = metadata.arch_value("rope.scaling.original_context_length")
    if original is not None:
        params["original_max_position_embeddings"] = int(original)
    # llama.cpp's rope.scaling.attn_factor multiplies the yarn magnitude scale
    # rather than replacing it as HF's attention_factor does, so it is not mapped.
    for gguf_suffix, hf_key in (
        ("rope.scaling.yarn_beta_fast", "beta_fast"),
        ("rope.scaling.yarn_beta_slow", "beta_slow"),
    ):
        value = metadata.arch_value(gguf_suffix)
        if value is not None and scaling == "yarn":
            params[hf_key] = float(value)
    return params


def generation_defaults(metadata: GGUFMetadata) -> dict[str, Any]:
    """``bos_token_id`` and ``eos_token_id`` (a list when the file names several stop tokens)."""
    defaults: dict[str, Any] = {}
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    if bos is not None:
        defaults["bos_token_id"] = int(bos)
    stops: list[int] = []
    for key in END_OF_GENERATION_KEYS:
        token_id = metadata.get(key)
        if token_id is not None and int(token_id) not in stops:
            stops.append(int(token_id))
    if stops:
        defaults["eos_token_id"] = stops[0] if len(stops) == 1 else stops
    return defaults


def _vocab_size(metadata: GGUFMetadata) -> int:
    # The embedding's row count is what the weights must fit; metadata may omit or pad it.
    if EMBEDDING_TENSOR in metadata.tensor_shapes:
        return metadata.tensor_shapes[EMBEDDING_TENSOR][0]
    declared = metadata.arch_value("vocab_size")
    if declared is not None:
        return int(declared)
    return metadata.array_lengths["tokenizer.ggml.tokens"]


def _head_dim(metadata: GGUFMetadata, hidden_size: int, num_heads: int) -> int:
    # The q projection's rows are the ground truth; Qwen3's heads (128 wide with
    # hidden 1024 / 16 heads) show hidden_size / num_heads can be wrong.
    q_shape = metadata.tensor_shapes.get("blk.0.attn_q.weight")
    if q_shape is not None:
        return q_shape[0] // num_heads
    key_length = metadata.arch_value("attention.key_length")
    return int(key_length) if key_length is not None else hidden_size // num_heads


def _token_ids(metadata: GGUFMetadata) -> dict[str, int]:
    return {attr: int(metadata.values[key]) for attr, key in CONFIG_TOKEN_IDS.items() if key in metadata.values}


def _arch_specific(metadata: GGUFMetadata, arch: GGUFArchitecture) -> dict[str, Any]:
    extras: dict[str, Any] = {}
    if arch.model_type in ("llama", "mistral", "qwen3"):
        # Qwen2 always has q/k/v biases; the others have them only if the file does.
        extras["attention_bias"] = "blk.0.attn_q.bias" in metadata.tensor_shapes
    if arch.model_type == "mistral":
        # llama.cpp runs these files with full attention; MistralConfig would default to a 4096 window.
        extras["sliding_window"] = None
    if arch.model_type == "gemma3_text":
        extras.update(_gemma3_extras(metadata))
    return extras


def _gemma3_extras(metadata: GGUFMetadata) -> dict[str, Any]:
    """Gemma 3's sliding window and its two ropes: the file's rope is the global layers';
    the sliding layers' base is llama.cpp's fixed 10,000 unless the file says otherwise.
    Scores are scaled by the head width, as llama.cpp does (every size but 27B, whose
    ``query_pre_attn_scalar`` the file does not keep). The every-sixth-layer-global
    pattern is Gemma3TextConfig's default, as in llama.cpp."""
    head_dim = _head_dim(metadata, int(metadata.require_arch_value("embedding_length")),
                         int(metadata.require_arch_value("attention.head_count")))
    sliding_base = float(metadata.arch_value("rope.freq_base_swa", 10000.0))
    return {
        "sliding_window": int(metadata.require_arch_value("attention.sliding_window")),
        "query_pre_attn_scalar": head_dim,
        "rope_parameters": {
            "full_attention": rope_parameters(metadata),
            "sliding_attention": {"rope_type": "default", "rope_theta": sliding_base},
        },
    }
