"""Per-layer KV-cache scales from a checkpoint: ``k_scale`` / ``v_scale`` tensors.

FP8 checkpoints that quantise the KV cache store one scalar per attention layer for its
keys and one for its values; compressed-tensors puts them on the attention module
(``model.layers.3.self_attn.k_scale``), ModelOpt on the projections
(``model.layers.3.self_attn.k_proj.k_scale``), and older exports one ``kv_scale`` for
both. They are no model parameter: the loader takes them out of the weight stream
before the model sees it (a model plugin needs to know nothing of them) and sets
``Attention.k_scale`` / ``v_scale`` of the attention layers under that module. A
layer without one keeps 1.0.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from tokenmill.layers.attention import Attention

logger = logging.getLogger(__name__)

_LEAVES = {"k_scale": ("k_scale",), "v_scale": ("v_scale",), "kv_scale": ("k_scale", "v_scale")}
_PROJECTIONS = ("k_proj", "v_proj", "attn")  # where ModelOpt (and tokenmill's own naming) hang them


def _scale_target(name: str) -> tuple[str, tuple[str, ...]] | None:
    """``(attention module path, attributes)`` for a KV-scale tensor's name, else None."""
    module_path, _, leaf = name.rpartition(".")
    if leaf not in _LEAVES or not module_path:
        return None
    owner, _, last = module_path.rpartition(".")
    if last in _PROJECTIONS and owner:
        module_path = owner
    return module_path, _LEAVES[leaf]


class KVScales:
    """Collects the KV-scale tensors out of a weight stream, then sets them on the model."""

    def __init__(self) -> None:
        self.found: dict[str, dict[str, float]] = {}

    def filter(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The stream without its KV-scale tensors (kept here)."""
        for name, tensor in weights:
            target = _scale_target(name)
            if target is None:
                yield name, tensor
                continue
            if tensor.numel() != 1:
                raise ValueError(f"KV-cache scale {name!r} has shape {tuple(tensor.shape)}: only per-tensor "
                                 "(one scalar per layer) KV scales are supported")
            value = float(tensor.float().item())
            if not value > 0 or value == float("inf"):
                raise ValueError(f"KV-cache scale {name!r} is {value}: it must be positive and finite")
            for attribute in target[1]:
                self.found.setdefault(target[0], {})[attribute] = value

    def apply(self, model: nn.Module) -> int:
        """Set the collected scales on the attention layers under their modules; returns how
        many layers got one. A scale for a module this model (or pipeline stage) lacks is skipped."""
        layers = [(path, m) for path, m in model.named_modules() if isinstance(m, Attention)]
        applied = 0
        for module_path, values in self.found.items():
            matches = [m for path, m in layers if path == module_path or path.startswith(module_path + ".")]
            for layer in matches:
                for attribute, value in values.items():
                    setattr(layer, attribute, value)
            applied += len(matches)
        if self.found:
            logger.info("KV-cache scales from the checkpoint for %d attention layers", applied)
        return applied
