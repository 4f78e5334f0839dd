"""GGUF tensor names to Hugging Face parameter names, for the llama family.

llama.cpp names tensors ``token_embd.weight`` and ``blk.<layer>.<leaf>.<kind>``;
transformers' Llama/Mistral/Qwen2/Qwen3 models share one layout, so one table
covers all four.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

BLOCK_LEAVES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # qwen3
    "attn_k_norm": "self_attn.k_norm",  # qwen3
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# Tensors llama.cpp adds that have no HF parameter: llama3 per-frequency rope
# factors (transformers computes them from the config instead).
NO_HF_PARAMETER = frozenset({"rope_freqs.weight"})

_BLOCK_NAME = re.compile(r"blk\.(?P<layer>\d+)\.(?P<leaf>\w+)\.(?P<kind>weight|bias)")
_TOP_NAME = re.compile(r"(?P<leaf>\w+)\.(?P<kind>weight|bias)")


def gguf_to_hf_name(gguf_name: str, leaf_overrides: Mapping[str, str] | None = None) -> str | None:
    """The HF name of a GGUF tensor; ``None`` for tensors with no HF parameter.
    ``leaf_overrides`` maps an architecture's block leaves that differ from the llama family's.

    Raises ``ValueError`` for a name outside the llama family, so a weight is
    never dropped silently.
    """
    if gguf_name in NO_HF_PARAMETER:
        return None
    if match := _BLOCK_NAME.fullmatch(gguf_name):
        leaf = (leaf_overrides or {}).get(match["leaf"]) or BLOCK_LEAVES.get(match["leaf"])
        if leaf is not None:
            return f"model.layers.{match['layer']}.{leaf}.{match['kind']}"
    elif match := _TOP_NAME.fullmatch(gguf_name):
        prefix = TOP_LEVEL.get(match["leaf"])
        if prefix is not None:
            return f"{prefix}.{match['kind']}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known Hugging Face name for the llama family")
