"""Registers ``FaultInjectionForCausalLM`` (no torch at import time).

A checkpoint opts in through its ``config.json``::

    "architectures": ["FaultInjectionForCausalLM"],
    "fault_injection": {"inner_architecture": "LlamaForCausalLM",
                        "raise_token": 380, "nan_token": 381, "sleep_token": 382, "sleep_s": 3.0}

The weights are the inner architecture's, unchanged.
"""

from tokenmill.plugin_api import ModelSpec, hookimpl

TOKENMILL_PLUGIN_API = 1


@hookimpl
def tokenmill_register_models() -> dict[str, ModelSpec]:
    return {"FaultInjectionForCausalLM": ModelSpec("tokenmill_fault_injection.model:FaultInjectionForCausalLM")}
