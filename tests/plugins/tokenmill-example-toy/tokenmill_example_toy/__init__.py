"""Registers the ``ToyLMForCausalLM`` architecture (no torch at import time)."""

from tokenmill.plugin_api import ModelSpec, hookimpl

TOKENMILL_PLUGIN_API = 1


@hookimpl
def tokenmill_register_models() -> dict[str, ModelSpec]:
    return {"ToyLMForCausalLM": ModelSpec("tokenmill_example_toy.model:ToyLMForCausalLM")}
