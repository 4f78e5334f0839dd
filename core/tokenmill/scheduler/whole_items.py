"""Prefill chunks that never end inside a multimodal item, for models whose items attend to
themselves both ways (Gemma 3's images: ``tokenmill.attention.item_blocks``).

An image's first token attends to its last one, so no step can compute a part of an image
without the rest: a chunk that would end inside an image is cut just before it, and the image
goes whole into a later step. A chunk that starts inside one (a prefix-cache hit that covers
the image's first blocks, computed whole by an earlier request) must reach its end, or waits.
The input processor refuses an image longer than a step's token budget, so every image fits
some step.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.multimodal.inputs import MultiModalItem


def whole_items_chunk(items: Sequence[MultiModalItem], start: int, num_new: int) -> int:
    """How many of the ``num_new`` tokens from ``start`` a step may take without ending inside
    one of ``items``: all, up to the item the chunk would cut, or 0 where it starts inside
    that item."""
    end = start + num_new
    for item in items:
        if item.offset < end < item.end:
            return max(0, item.offset - start)
    return num_new
