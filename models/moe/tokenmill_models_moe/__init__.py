"""Mixture-of-experts model plugin: Mixtral, Qwen2-MoE and Qwen3-MoE decoders.

This module is the entry point: it imports no torch; the classes load lazily.
"""

from tokenmill.plugin_api import ModelSpec, hookimpl

TOKENMILL_PLUGIN_API = 1

_MODULE = "tokenmill_models_moe.models"
ARCHITECTURES = {
    "MixtralForCausalLM": f"{_MODULE}:MixtralForCausalLM",
    "Qwen2MoeForCausalLM": f"{_MODULE}:Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": f"{_MODULE}:Qwen3MoeForCausalLM",
}


@hookimpl
def tokenmill_register_models() -> dict[str, ModelSpec]:
    return {arch: ModelSpec(qualname) for arch, qualname in ARCHITECTURES.items()}
