"""Tiny random mixture-of-experts checkpoints built with transformers, for golden tests.

8 experts, top-2, small hidden sizes, saved with ``save_pretrained`` (transformers
writes one tensor per expert, ``experts.N.w1.weight`` / ``experts.N.gate_proj.weight``,
as the published checkpoints hold them). The router weights are widened so that the
top-2 choice is not decided by float rounding between two near-equal scores.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tiny_models import COMMON, build_tokenizer

_MOE = dict(num_experts_per_tok=2)
MOE_ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {**_MOE, "num_local_experts": 8}),
    # a shared expert with its gate; layer 1 of 3 dense (mlp_only_layers)
    "qwen2-moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        **_MOE, "num_experts": 8, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
        "num_hidden_layers": 3, "mlp_only_layers": [1]}),
    # experts every second layer of 4 (decoder_sparse_step), top-k renormalised
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        **_MOE, "num_experts": 8, "moe_intermediate_size": 32, "head_dim": 16, "norm_topk_prob": True,
        "num_hidden_layers": 4, "decoder_sparse_step": 2}),
}


def build_moe_model(folder: Path, arch: str, seed: int = 0) -> Path:
    """Save a tiny random MoE model of ``arch`` (and the shared tokenizer) into ``folder``."""
    import torch
    import transformers

    config_name, model_name, extra = MOE_ARCHS[arch]
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**{**COMMON, **extra})
    model = getattr(transformers, model_name)(config).to(torch.float32)
    with torch.no_grad():  # random init gives near-uniform logits; widen them so argmax is robust
        model.lm_head.weight.normal_(0, 0.5)
        for name, param in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                param.normal_(0, 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    build_tokenizer(folder)
    return folder
