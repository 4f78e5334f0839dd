"""Llama-family model plugin: Llama, Mistral, Qwen2, Qwen3 and Phi-3 decoders.

This module is the entry point: it imports no torch; the classes load lazily.
"""

from tokenmill.plugin_api import ModelSpec, hookimpl

TOKENMILL_PLUGIN_API = 1

_MODULE = "tokenmill_models_llama.llama"
ARCHITECTURES = {
    "LlamaForCausalLM": f"{_MODULE}:LlamaForCausalLM",
    "MistralForCausalLM": f"{_MODULE}:LlamaForCausalLM",
    "Qwen2ForCausalLM": f"{_MODULE}:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": f"{_MODULE}:Qwen3ForCausalLM",
    "Phi3ForCausalLM": f"{_MODULE}:Phi3ForCausalLM",
}


@hookimpl
def tokenmill_register_models() -> dict[str, ModelSpec]:
    return {arch: ModelSpec(qualname) for arch, qualname in ARCHITECTURES.items()}
