"""Multi-section rotary positions (M-RoPE, Qwen2-VL): each token has three positions,
temporal, height and width, and the rotary frequencies are cut into three sections
(``mrope_section``, summing to ``head_size / 2``), each turned by its own position.

A text token has the same position in all three, which makes M-RoPE exactly the ordinary
rotary embedding at that position; so the layer takes either ``positions`` ``[T]`` (every
token's three positions equal: decode steps, text-only prompts) or ``[3, T]`` (a step with
image or video tokens), and the one-dimensional case is the plain table lookup, whatever
kernel the platform runs for it.

The prompt's positions come from :func:`mrope_prompt_positions`, as transformers'
``get_rope_index`` computes them: text tokens count on from the last position, an item's
tokens are its (t, h, w) grid offset by the position it starts at, and the text after it
starts past the item's largest spatial extent. Tokens after the prompt (decoding) continue
at ``position + delta`` in all three sections, ``delta`` being how far the prompt's last
M-RoPE position lies from its last index.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tokenmill.layers.ops import layer_ops
from tokenmill.layers.rotary import RotaryEmbedding


class MRotaryEmbedding(RotaryEmbedding):
    """The rotary table of a config whose ``rope_parameters`` hold ``mrope_section``."""

    section_of_column: torch.Tensor

    def __init__(self, hf_config: Any, head_size: int, max_position: int, layer_type: str | None = None) -> None:
        super().__init__(hf_config, head_size, max_position, layer_type)
        section = [int(s) for s in (getattr(hf_config, "rope_parameters", None) or {})["mrope_section"]]
        if sum(section) * 2 != head_size:
            raise ValueError(f"mrope_section {section} must sum to half the head size {head_size}")
        # Column j of the table (either half) is rotated by the position of section owner[j].
        owner = np.repeat(np.arange(len(section)) % 3, section)
        self.register_buffer("section_of_column", torch.from_numpy(np.concatenate([owner, owner])).to(
            self.cos_cache.device), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` ``[T]`` (the three sections equal) or ``[3, T]``."""
        if positions.dim() == 1:
            return super().forward(positions, q, k)
        columns = self.section_of_column
        # The step's own table, one row per token (row i: token i's sections gathered), rotated by
        # the platform's kernel at positions 0..T-1.
        rows = positions[columns, :].T  # [T, head_size]: the position each column of each token turns by
        index = torch.arange(columns.shape[0], device=positions.device)
        cos, sin = self.cos_cache[rows, index], self.sin_cache[rows, index]
        step = torch.arange(positions.shape[1], device=positions.device)
        return layer_ops(q.device).rotary(step, q, k, cos.contiguous(), sin.contiguous())


@dataclass(frozen=True)
class MRopeItem:
    """An item's place in the prompt for M-RoPE: its first token and its grid in language-model
    tokens (``t`` temporal, ``h`` and ``w`` after the spatial merge); ``time_interval`` spaces
    its temporal positions (1 for Qwen2-VL)."""

    offset: int
    t: int
    h: int
    w: int
    time_interval: float = 1.0

    @property
    def length(self) -> int:
        return self.t * self.h * self.w


def mrope_prompt_positions(num_tokens: int, items: Sequence[MRopeItem]) -> tuple[np.ndarray, int]:
    """``(positions [3, num_tokens], delta)`` of a prompt whose items sit where ``items`` say
    (in prompt order, not overlapping); ``delta``: what decode positions add to their index."""
    positions = np.zeros((3, num_tokens), dtype=np.int64)
    index = current = 0
    for item in items:
        text = item.offset - index
        positions[:, index:item.offset] = np.arange(current, current + text)
        current += text
        t, h, w = np.meshgrid((np.arange(item.t) * item.time_interval).astype(np.int64), np.arange(item.h),
                              np.arange(item.w), indexing="ij")
        positions[:, item.offset:item.offset + item.length] = np.stack([t.ravel(), h.ravel(), w.ravel()]) + current
        current += max(item.h, item.w)
        index = item.offset + item.length
    positions[:, index:] = np.arange(current, current + num_tokens - index)
    last = int(positions.max()) if num_tokens else -1
    return positions, last + 1 - num_tokens
