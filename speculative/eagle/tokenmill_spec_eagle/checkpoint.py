"""Reading an EAGLE head's folder: ``config.json`` (a Llama config) and its weights, as
safetensors or as ``pytorch_model*.bin`` (the format of the first published heads), and
loading them into a head. EAGLE-1 and EAGLE-3 heads load the same way; what tells their
checkpoints apart is a :class:`HeadLayout`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

# Shared with the target (the head's copy, where a checkpoint carries one, is the target's).
_SHARED_PREFIXES = ("embed_tokens.", "lm_head.")


@dataclass(frozen=True)
class HeadLayout:
    """One EAGLE generation's checkpoint layout. ``name`` and ``head`` name it in errors
    (``the {head} {path} does not match the {name} layout``)."""

    name: str
    head: str
    shared_prefixes: tuple[str, ...]  # tensors dropped: the target's own are used
    unused: tuple[str, ...] = ()  # tensors dropped: drafting does not read them


EAGLE1_LAYOUT = HeadLayout("EAGLE-1", "EAGLE head", _SHARED_PREFIXES)
# An EAGLE-3 head keeps its own lm_head (and some their own embedding); ``t2d``, the target ->
# draft mask, says what ``d2t`` says the other way: drafting reads ``d2t`` only.
EAGLE3_LAYOUT = HeadLayout("EAGLE-3", "EAGLE-3 head", (), unused=("t2d",))


def read_head_weights(path: str, shared_prefixes: tuple[str, ...] = _SHARED_PREFIXES) -> dict[str, torch.Tensor]:
    """The head's tensors by name (``fc.weight``, ``layers.0....``), on the CPU, less those
    under ``shared_prefixes`` (an EAGLE-3 head keeps its own lm_head: it passes none)."""
    folder = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    safetensors = sorted(folder.glob("*.safetensors"))
    if safetensors:
        from safetensors.torch import load_file

        for file in safetensors:
            tensors.update(load_file(str(file)))
    else:
        bins = sorted(folder.glob("pytorch_model*.bin"))
        if not bins:
            raise ValueError(f"the EAGLE head {path} has no weights (*.safetensors or pytorch_model*.bin)")
        for file in bins:
            tensors.update(torch.load(file, map_location="cpu", weights_only=True))
    named = {name.removeprefix("model."): tensor for name, tensor in tensors.items()}
    return {name: tensor for name, tensor in named.items() if not (shared_prefixes and name.startswith(shared_prefixes))}


def read_head(path: str, layout: HeadLayout) -> tuple[Any, dict[str, torch.Tensor]]:
    """The head's Llama config and the tensors of ``layout`` it loads."""
    from transformers import LlamaConfig

    config = LlamaConfig.from_pretrained(path)
    weights = read_head_weights(path, layout.shared_prefixes)
    return config, {name: tensor for name, tensor in weights.items() if name not in layout.unused}


def trained_for_another_target(path: str, layout: HeadLayout, head_hidden: int, target_hidden: int) -> ValueError:
    return ValueError(f"the {layout.head} {path} has hidden_size {head_hidden}, the target {target_hidden}: "
                      "a head is trained for one target model")


def check_shapes(path: str, layout: HeadLayout, weights: dict[str, torch.Tensor],
                 expected: dict[str, tuple[int, ...]]) -> None:
    """Each tensor named in ``expected`` is there with that shape (``fc``'s says which target
    a head was trained for, better said here than by ``load_state_dict``)."""
    for name, shape in expected.items():
        found = weights.get(name)
        if found is None or tuple(found.shape) != shape:
            raise ValueError(f"the {layout.head} {path} needs a {name} of shape {shape} ({layout.name} layout), "
                             f"found {'none' if found is None else tuple(found.shape)}")


def load_head(build: Callable[[], nn.Module], weights: dict[str, torch.Tensor], path: str,
              layout: HeadLayout) -> nn.Module:
    """``build()``'s head, made on the CPU, with ``weights`` loaded: every parameter of it
    must be among them and every one of them a parameter."""
    with torch.device("cpu"):
        head = build()
    missing, unexpected = head.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ValueError(f"the {layout.head} {path} does not match the {layout.name} layout: "
                         f"missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    return head
