"""GPT-2 and GPT-NeoX: two decoder layouts that are not Llama's (LayerNorm with biases, a
plain GELU MLP, fused q/k/v in their own orders; GPT-2's learned absolute positions and
Conv1D weights, GPT-NeoX's parallel residual and partial rotary).

This module is the entry point: it imports no torch; the classes load lazily.
"""

from tokenmill.plugin_api import ModelSpec, hookimpl

TOKENMILL_PLUGIN_API = 1


@hookimpl
def tokenmill_register_models() -> dict[str, ModelSpec]:
    return {
        "GPT2LMHeadModel": ModelSpec("tokenmill_models_gpt.gpt2:GPT2LMHeadModel"),
        "GPTNeoXForCausalLM": ModelSpec("tokenmill_models_gpt.gpt_neox:GPTNeoXForCausalLM"),
    }
