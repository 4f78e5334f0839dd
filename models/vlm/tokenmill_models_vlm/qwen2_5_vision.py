"""Qwen2.5-VL's vision transformer: Qwen2-VL's patches, rotary positions and merger, with
RMSNorm, a gated SiLU MLP, and window attention: most blocks attend within windows of
``window_size`` pixels (squares of merged tokens), the blocks of ``fullatt_block_indexes``
within a whole frame.

The patches are reordered window by window before the blocks (a window's tokens next to
each other, each frame's windows together, so a frame stays contiguous too) and put back
in the processor's order after the merger, as transformers does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers import RMSNorm
from tokenmill_models_vlm.qwen2_vision import Grid, PatchEmbed, VisionAttention, VisionRotary


def window_order(grids: Sequence[Grid], merge: int, window: int) -> tuple[np.ndarray, list[int]]:
    """``(order, lengths)``: the merged tokens (index in the processor's order) window after
    window, and each window's length in patches. ``window``: a window's side in merged tokens;
    the windows at a frame's right and bottom edges are cut short."""
    order, lengths, base = [], [], 0
    for t, h, w in grids:
        rows, cols = h // merge, w // merge
        index = np.arange(t * rows * cols).reshape(t, rows, cols) + base
        for frame in index:
            for top in range(0, rows, window):
                for left in range(0, cols, window):
                    block = frame[top:top + window, left:left + window].ravel()
                    order.append(block)
                    lengths.append(block.size * merge * merge)
        base += t * rows * cols
    return np.concatenate(order), lengths


class GatedMLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen2_5VisionBlock(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        dim = config.hidden_size
        if config.hidden_act != "silu":
            raise ValueError(f"Qwen2.5-VL's vision MLP with hidden_act {config.hidden_act!r} is not supported (silu)")
        self.norm1 = RMSNorm(dim, eps=1e-6)
        self.norm2 = RMSNorm(dim, eps=1e-6)
        self.attn = VisionAttention(dim, config.num_heads)
        self.mlp = GatedMLP(dim, config.intermediate_size)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], segments: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rotary, segments)
        return x + self.mlp(self.norm2(x))


class Qwen2_5PatchMerger(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.width = config.hidden_size * config.spatial_merge_size ** 2
        self.ln_q = RMSNorm(config.hidden_size, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(),
                                 nn.Linear(self.width, config.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class Qwen2_5VisionTransformer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.merge = config.spatial_merge_size
        self.window = config.window_size // config.spatial_merge_size // config.patch_size
        self.full_attention = frozenset(config.fullatt_block_indexes)
        self.patch_embed = PatchEmbed(config.in_channels, config.temporal_patch_size, config.patch_size,
                                      config.hidden_size)
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        self.rotary = VisionRotary(config.hidden_size // config.num_heads, theta)
        self.blocks = nn.ModuleList(Qwen2_5VisionBlock(config) for _ in range(config.depth))
        self.merger = Qwen2_5PatchMerger(config)

    def forward(self, pixels: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        """Language-model embeddings ``[sum(t*h*w) / merge², hidden]`` of the items whose
        flattened patches ``pixels`` are, item after item (in the processor's order)."""
        frames = [h * w for t, h, w in grids for _ in range(t)]
        order_np, windows = window_order(grids, self.merge, self.window)
        order = torch.from_numpy(order_np).to(pixels.device)
        unit = self.merge ** 2

        def windowed(x: torch.Tensor) -> torch.Tensor:
            return x.reshape(-1, unit, x.shape[-1])[order].reshape(x.shape)

        cos, sin = self.rotary(grids, self.merge)
        rotary = (windowed(cos), windowed(sin))
        x = windowed(self.patch_embed(pixels))
        for index, block in enumerate(self.blocks):
            x = block(x, rotary, frames if index in self.full_attention else windows)
        return self.merger(x)[torch.argsort(order)]
