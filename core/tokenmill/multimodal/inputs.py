"""One multimodal item of a prompt: its processed tensors and where its tokens sit."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(eq=False)
class MultiModalItem:
    """An image (or video) of one prompt, after the processor.

    ``offset`` is the position of its first placeholder token in the prompt and ``length``
    the number of placeholder tokens, each of which takes one row of the encoder's output
    for it. ``data`` holds the processor's tensors for this item alone (``pixel_values``
    ``[1, 3, H, W]`` for LLaVA), which the model's ``embed_multimodal`` reads.
    ``content_hash`` names the item by its pixels and the processor options, so two requests
    sending the same picture share one encoder output (the encoder cache) and the KV blocks
    its tokens fill (the prefix cache's extra key).
    """

    modality: str
    offset: int
    length: int
    content_hash: str
    data: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlap(self, start: int, end: int) -> tuple[int, int] | None:
        """The part of positions [start, end) that are this item's tokens, if any."""
        lo, hi = max(start, self.offset), min(end, self.end)
        return (lo, hi) if lo < hi else None


def content_hash(modality: str, data: Mapping[str, torch.Tensor], options: Mapping[str, Any]) -> str:
    """A sha256 over the item's tensors (names, dtypes, shapes and bytes) and the processor
    options that produced them: equal only for the same pixels processed the same way."""
    digest = hashlib.sha256(modality.encode())
    digest.update(json.dumps(dict(options), sort_keys=True, default=str).encode())
    for name in sorted(data):
        tensor = data[name].detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()
