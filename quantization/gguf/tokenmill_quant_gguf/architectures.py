"""Which GGUF architectures this plugin loads, and as what.

llama.cpp names the architecture in ``general.architecture``. Mistral models
are converted as ``llama`` (same tensors, same q/k permutation); like
transformers, we recognise them by ``general.name``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill_quant_gguf.metadata import GGUFMetadata


@dataclass(frozen=True)
class GGUFArchitecture:
    """How one GGUF architecture maps onto a transformers model."""

    gguf_name: str
    model_type: str  # transformers ``model_type`` (AutoConfig key)
    hf_architecture: str  # ``config.architectures[0]``
    # llama.cpp's converter interleaves the rotary halves of q and k rows for
    # these archs (its rope rotates adjacent pairs); HF rotates halves.
    permuted_qk: bool
    # GGUF leaf names whose HF name differs from the llama family's (tensor_names.BLOCK_LEAVES)
    leaf_overrides: dict[str, str] = field(default_factory=dict)
    # llama.cpp stores Gemma's ``1 + w`` norm weights; HF checkpoints hold ``w``
    norm_weight_offset: float = 0.0


LLAMA = GGUFArchitecture("llama", "llama", "LlamaForCausalLM", permuted_qk=True)
MISTRAL = GGUFArchitecture("llama", "mistral", "MistralForCausalLM", permuted_qk=True)
QWEN2 = GGUFArchitecture("qwen2", "qwen2", "Qwen2ForCausalLM", permuted_qk=False)
QWEN3 = GGUFArchitecture("qwen3", "qwen3", "Qwen3ForCausalLM", permuted_qk=False)
# Gemma 3 norms the attention and MLP outputs too: ffn_norm is the MLP's input norm there.
GEMMA3 = GGUFArchitecture("gemma3", "gemma3_text", "Gemma3ForCausalLM", permuted_qk=False, leaf_overrides={
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}, norm_weight_offset=-1.0)

SUPPORTED = {arch.gguf_name: arch for arch in (LLAMA, QWEN2, QWEN3, GEMMA3)}


def architecture_of(metadata: GGUFMetadata) -> GGUFArchitecture:
    """The architecture a GGUF file holds; ``ValueError`` for ones we cannot load."""
    name = metadata.architecture
    if name not in SUPPORTED:
        raise ValueError(
            f"GGUF architecture {name!r} is not supported by tokenmill-quant-gguf "
            f"(supported: {', '.join(sorted(SUPPORTED))})"
        )
    if name == "llama" and "mistral" in str(metadata.get("general.name", "")).lower():
        return MISTRAL
    return SUPPORTED[name]
