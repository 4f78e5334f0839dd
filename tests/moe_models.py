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
# DeepSeek latent attention: 4 heads of 24 + 8 key features and 16 value features, 3 layers
_MLA = dict(num_experts_per_tok=2, num_key_value_heads=4, num_hidden_layers=3, first_k_dense_replace=1,
            moe_intermediate_size=32, kv_lora_rank=32, qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=16)
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
    # latent attention without a query latent, interleaved rope; layer 0 dense (first_k_dense_replace);
    # group-limited greedy softmax routing over 4 groups, two shared experts
    "deepseek-v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", {
        **_MLA, "n_routed_experts": 8, "q_lora_rank": None, "n_shared_experts": 2, "topk_method": "group_limited_greedy",
        "n_group": 4, "topk_group": 2, "routed_scaling_factor": 1.5}),
    # a query latent, YaRN rope (factor 4 over 32 positions, mscale_all_dim: the softmax scale
    # changes too), sigmoid routing with a correction bias over 2 of 4 groups, renormalised
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        **_MLA, "n_routed_experts": 8, "q_lora_rank": 48, "n_shared_experts": 1, "n_group": 4, "topk_group": 2,
        "norm_topk_prob": True, "routed_scaling_factor": 2.5, "max_position_embeddings": 128,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
                            "mscale": 1.0, "mscale_all_dim": 1.0}}),
}


def build_moe_model(folder: Path, arch: str, seed: int = 0, **overrides: Any) -> Path:
    """Save a tiny random MoE model of ``arch`` (and the shared tokenizer) into ``folder``;
    ``overrides`` change its config (``num_local_experts=7``)."""
    import torch
    import transformers

    config_name, model_name, extra = MOE_ARCHS[arch]
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**{**COMMON, **extra, **overrides})
    model = getattr(transformers, model_name)(config).to(torch.float32)
    with torch.no_grad():  # random init gives near-uniform logits; widen them so argmax is robust
        model.lm_head.weight.normal_(0, 0.5)
        for name, param in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                param.normal_(0, 0.5)
            if name.endswith("e_score_correction_bias"):  # zero at init: make it change some choices
                param.normal_(0, 0.3)
    model.save_pretrained(folder, safe_serialization=True)
    build_tokenizer(folder)
    return folder
