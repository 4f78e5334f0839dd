"""Which linear layers of a base model an adapter may target, and their shapes.

A PEFT adapter names the checkpoint's modules (``model.layers.0.self_attn.q_proj``); the
model may compute several of them in one merged layer (q/k/v in ``qkv_proj``, gate/up in
``gate_up_proj``, named by the model class's ``packed_modules``). The table maps each
checkpoint module to its layer's prefix and output slice, so an adapter's A/B go into the
merged layer's slices. The vocabulary layers, the token embedding (``embed_tokens``: PEFT's
``lora_embedding_A`` [r, vocab] and ``lora_embedding_B`` [hidden, r]) and the ``lm_head``, are
targets too (:mod:`tokenmill.lora.vocab_layers`). It is plain data, so the engine process
validates adapters against it without holding the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from tokenmill.layers.embedding import VocabEmbedding
from tokenmill.layers.linear import Linear
from tokenmill.layers.lm_head import ParallelLMHead

# The projections of a decoder layer LoRA applies to (vLLM's and PEFT's usual targets).
SUPPORTED_MODULES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})
# The vocabulary layers, wrapped by tokenmill.lora.vocab_layers: the model's VocabEmbedding and ParallelLMHead.
VOCAB_MODULES = frozenset({"embed_tokens", "lm_head"})


@dataclass(frozen=True)
class LoRATarget:
    """One checkpoint module: the layer that computes it, its slice, and the shapes A/B must have."""

    layer: str  # the Linear's prefix, e.g. model.layers.0.self_attn.qkv_proj
    slice_index: int
    in_features: int
    out_features: int
    kind: str = "linear"  # or "embedding" (in: the vocabulary, out: hidden) or "lm_head" (out: the vocabulary)


LoRATargetTable = dict[str, LoRATarget]  # checkpoint module name -> target


def lora_target_layers(model: nn.Module) -> dict[str, tuple[Linear, list[str]]]:
    """The model's layers LoRA can wrap: prefix -> (layer, the checkpoint modules of its slices)."""
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules", {}))
    layers = {}
    for module in model.modules():
        if not isinstance(module, Linear) or not module.prefix:
            continue
        parent, _, leaf = module.prefix.rpartition(".")
        names = packed.get(leaf, [leaf])
        if len(names) != len(module.output_partition_sizes) or not set(names) <= SUPPORTED_MODULES:
            continue
        layers[module.prefix] = (module, [f"{parent}.{name}" if parent else name for name in names])
    return layers


def lora_target_table(model: nn.Module) -> LoRATargetTable:
    """The checkpoint's shapes (an adapter is whole): under tensor parallelism a layer holds one
    rank's part, so its input (row-parallel) or each output shard (column-parallel) is scaled back."""
    table = {}
    for prefix, (layer, names) in lora_target_layers(model).items():
        loader = layer.output_loader
        in_features = layer.in_features * (loader.world_size if layer.parallel == "row" else 1)
        for index, name in enumerate(names):
            parts = loader.shard_parts[index] if layer.parallel == "column" and loader.shard_parts else 1
            table[name] = LoRATarget(prefix, index, in_features, layer.output_partition_sizes[index] * parts)
    for prefix, module in lora_vocab_layers(model).items():  # whole on every rank: the checkpoint's shapes
        if isinstance(module, VocabEmbedding):
            table[prefix] = LoRATarget(prefix, 0, module.vocab_size, module.embedding_dim, "embedding")
        else:
            table[prefix] = LoRATarget(prefix, 0, module.in_features, module.vocab_size, "lm_head")
    return table


def lora_vocab_layers(model: nn.Module) -> dict[str, VocabEmbedding | ParallelLMHead]:
    """The model's token embedding and lm_head, by prefix (the checkpoint module an adapter names)."""
    return {module.prefix: module for module in model.modules()
            if isinstance(module, VocabEmbedding | ParallelLMHead) and module.prefix
            and module.prefix.rpartition(".")[2] in VOCAB_MODULES}
