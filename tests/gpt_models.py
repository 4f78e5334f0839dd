"""Tiny random GPT-2 and GPT-NeoX checkpoints (``test_golden_gpt.py``), built like
``tiny_models`` (same vocabulary, tokenizer and special ids).

Weights are widened past transformers' initialisation (std 0.02: near-uniform logits, and
norms and biases that are all ones and zeros, which a misplaced or transposed one would not
show): every projection, norm and bias gets random values of its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tiny_models import COMMON, build_tokenizer

_IDS = {key: COMMON[key] for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")}
_NEOX = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=256, **_IDS)

GPT_ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, **_IDS)),
    # half of each 16-wide head rotated, attention and MLP side by side
    "gpt-neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(
        _NEOX, use_parallel_residual=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    # a quarter rotated, attention then MLP, head tied to the embedding
    "gpt-neox-sequential": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(
        _NEOX, use_parallel_residual=False, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})),
}


def build_gpt_model(folder: Path, arch: str, seed: int = 0) -> Path:
    import torch
    import transformers

    config_name, model_name, options = GPT_ARCHS[arch]
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**options)
    model = getattr(transformers, model_name)(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ("ln" in name or "layernorm" in name or "layer_norm" in name) and name.endswith("weight"):
                param.normal_(1.0, 0.2)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
            else:
                param.normal_(0.0, 0.5 if ("wte" in name or "embed" in name) else 0.15)
    model.save_pretrained(folder, safe_serialization=True)
    build_tokenizer(folder)
    return folder
