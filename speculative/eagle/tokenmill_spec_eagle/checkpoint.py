"""Reading an EAGLE head's folder: ``config.json`` (a Llama config) and its weights, as
safetensors or as ``pytorch_model*.bin`` (the format of the first published heads)."""

from __future__ import annotations

from pathlib import Path

import torch

# Shared with the target (the head's copy, where a checkpoint carries one, is the target's).
_SHARED_PREFIXES = ("embed_tokens.", "lm_head.")


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
