"""Tiny random Gemma 2, Gemma 3 and Phi-3 checkpoints for the golden tests of the
non-Llama families (``test_golden_families.py``).

Built like ``tiny_models`` (same vocabulary, tokenizer and sizes), with a few
weights widened so that what sets these families apart shows in the tokens:
transformers initialises Gemma's norms at ``w = 0`` (a ``1 + w`` mistaken for ``w``
would still zero everything, but a ``w`` mistaken for ``1 + w`` would not show), ties
the head to a narrow embedding (near-uniform logits) and gives attention scores far
below any soft cap.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tiny_models import COMMON, build_tokenizer

GEMMA_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
}
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0, 1.1, 1.2, 1.3, 1.5, 1.8, 2.0, 2.5],
    "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
    "original_max_position_embeddings": 20,
}

FAMILY_ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # three layers: sliding, global, sliding; a 16-token window, shorter than most prompts
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "num_hidden_layers": 3, "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": GEMMA_ROPE, "tie_word_embeddings": False,
    }),
    "gemma3-tied": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "num_hidden_layers": 3, "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": GEMMA_ROPE,
    }),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {
        "num_hidden_layers": 3, "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 16,
        "attn_logit_softcapping": 1.5, "final_logit_softcapping": 4.0,
        "tie_word_embeddings": False,
    }),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": 24}),
    # sequences longer than 20 tokens use the long factors
    "phi3-longrope": ("Phi3Config", "Phi3ForCausalLM", {
        "num_key_value_heads": 4, "original_max_position_embeddings": 20, "rope_parameters": LONGROPE,
    }),
}


def build_family_model(folder: Path, arch: str, seed: int = 0) -> Path:
    """Save a tiny random model of ``arch`` (and the shared tokenizer) into ``folder``."""
    import torch
    import transformers

    config_name, model_name, extra = FAMILY_ARCHS[arch]
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**{**COMMON, **extra})
    model = getattr(transformers, model_name)(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and arch.startswith("gemma"):
                param.normal_(0.0, 0.3)  # w, applied as 1 + w
            elif "q_proj" in name or "k_proj" in name or "qkv_proj" in name:
                param.normal_(0.0, 0.15)  # scores of a few units: a cap of 1.5 bends them
        if not config.tie_word_embeddings:
            model.lm_head.weight.normal_(0.0, 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    build_tokenizer(folder)
    return folder
