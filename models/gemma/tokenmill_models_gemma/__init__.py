"""Gemma-family model plugin: Gemma 2 and the Gemma 3 text decoder.

This module is the entry point: it imports no torch; the classes load lazily.
"""

from tokenmill.plugin_api import ModelSpec, hookimpl

TOKENMILL_PLUGIN_API = 1

_MODULE = "tokenmill_models_gemma.gemma"
ARCHITECTURES = {
    "Gemma2ForCausalLM": f"{_MODULE}:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": f"{_MODULE}:Gemma3ForCausalLM",
}


@hookimpl
def tokenmill_register_models() -> dict[str, ModelSpec]:
    return {arch: ModelSpec(qualname) for arch, qualname in ARCHITECTURES.items()}
