"""Mixture-of-experts model plugin: Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2 and -V3 decoders.

This module is the entry point: it imports no torch; the classes load lazily.
"""

from tokenmill.plugin_api import ModelSpec, hookimpl

TOKENMILL_PLUGIN_API = 1

_MODULE = "tokenmill_models_moe.models"
ARCHITECTURES = {
    "MixtralForCausalLM": f"{_MODULE}:MixtralForCausalLM",
    "Qwen2MoeForCausalLM": f"{_MODULE}:Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": f"{_MODULE}:Qwen3MoeForCausalLM",
    "DeepseekV2ForCausalLM": "tokenmill_models_moe.deepseek:DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "tokenmill_models_moe.deepseek:DeepseekV3ForCausalLM",
}


@hookimpl
def tokenmill_register_models() -> dict[str, ModelSpec]:
    return {arch: ModelSpec(qualname) for arch, qualname in ARCHITECTURES.items()}
