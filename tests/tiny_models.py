"""Tiny random-weight checkpoints built with transformers, for golden tests.

No hub is reachable, so tests make their own: a byte-level BPE tokenizer
trained on a few sentences, and small Llama / Mistral / Qwen2 / Qwen3
models saved with ``save_pretrained`` (safetensors), exactly as a real
checkpoint folder looks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# The tokenizer and the builders live in the conformance kit, which plugins' own test suites use too.
from tokenmill.testing.tiny_models import (
    CORPUS,
    TINY_DIMENSIONS,
    VOCAB_SIZE,
    build_tokenizer,
    hf_greedy,
    save_random_model,
)

__all__ = ["ARCHS", "COMMON", "CORPUS", "VOCAB_SIZE", "build_model", "build_tokenizer", "hf_greedy"]


COMMON = dict(TINY_DIMENSIONS)  # the kit's tiny sizes, vocabulary and special-token ids

ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama-tied-llama3rope": ("LlamaConfig", "LlamaForCausalLM", {
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    }),
    "llama-yarn": ("LlamaConfig", "LlamaForCausalLM", {
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 64},
    }),
    "llama-linear-rope": ("LlamaConfig", "LlamaForCausalLM", {
        "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    }),
    "llama-dynamic-rope": ("LlamaConfig", "LlamaForCausalLM", {
        "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    }),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 16, "head_dim": 16}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "llama-one-kv-head": ("LlamaConfig", "LlamaForCausalLM", {"num_key_value_heads": 1}),
}


def build_model(folder: Path, arch: str, seed: int = 0) -> Path:
    """Save a tiny random model of ``arch`` (and the shared tokenizer) into ``folder``."""
    import transformers

    config_name, model_name, extra = ARCHS[arch]
    return save_random_model(folder, getattr(transformers, config_name)(**{**COMMON, **extra}), model_name, seed)
