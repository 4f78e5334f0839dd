"""Qwen2-VL's vision transformer: patches of ``temporal_patch_size`` frames by
``patch_size``² pixels (the processor flattens them), 2-D rotary positions over each
frame's patch grid, attention within one frame at a time, and a merger that folds each
``spatial_merge_size``² block of neighbouring patches into one language-model token.

The processor lays a frame's patches out block by block (the patches of one merge block
next to each other), so the merger's fold is a plain reshape, and the rotary positions
below follow the same order. No KV cache and no attention backend: one
``scaled_dot_product_attention`` per frame.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill_models_vlm.clip import ACTIVATIONS

Grid = tuple[int, int, int]  # (t, h, w) in patches, as the processor's *_grid_thw


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class VisionRotary(nn.Module):
    """The angles of each patch: the first half of the head's frequencies turn by its row,
    the second by its column (transformers' axial rope)."""

    inv_freq: torch.Tensor

    def __init__(self, head_size: int, theta: float) -> None:
        super().__init__()
        spatial = head_size // 2
        inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float, device="cpu") / spatial))
        self.register_buffer("inv_freq", inv_freq.to(torch.get_default_device()), persistent=False)

    def forward(self, grids: Sequence[Grid], merge: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[patches, head_size]`` in the processor's patch order."""
        rows, cols = [], []
        for t, h, w in grids:
            hpos, wpos = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            blocks = (h // merge, merge, w // merge, merge)
            rows.append(hpos.reshape(blocks).transpose(1, 2).flatten().repeat(t))
            cols.append(wpos.reshape(blocks).transpose(1, 2).flatten().repeat(t))
        positions = torch.stack([torch.cat(rows), torch.cat(cols)], dim=-1).to(self.inv_freq.device)
        freqs = positions[..., None].float() * self.inv_freq  # [patches, 2, head/4]
        half = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        angles = torch.cat([half, half], dim=-1)
        return angles.cos(), angles.sin()


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], frames: list[int]) -> torch.Tensor:
        """``x`` ``[patches, dim]``; ``frames``: the patches of each frame, in order (attention
        stays within one)."""
        tokens, dim = x.shape
        q, k, v = self.qkv(x).view(tokens, 3, self.num_heads, -1).unbind(1)
        cos, sin = (t.unsqueeze(1) for t in rotary)
        dtype = q.dtype
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(dtype)
        outs = [F.scaled_dot_product_attention(*(t.transpose(0, 1).unsqueeze(0) for t in parts))
                for parts in zip(q.split(frames), k.split(frames), v.split(frames), strict=True)]
        out = torch.cat([o.squeeze(0).transpose(0, 1) for o in outs])
        return self.proj(out.reshape(tokens, dim))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        dim = config.embed_dim
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = VisionAttention(dim, config.num_heads)
        self.mlp = VisionMLP(dim, int(dim * config.mlp_ratio), config.hidden_act)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], frames: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rotary, frames)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, in_channels: int, temporal_patch_size: int, patch_size: int, dim: int) -> None:
        super().__init__()
        self.shape = (in_channels, temporal_patch_size, patch_size, patch_size)
        self.proj = nn.Conv3d(in_channels, dim, kernel_size=self.shape[1:], stride=self.shape[1:], bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = pixels.to(self.proj.weight.dtype).view(-1, *self.shape)
        return self.proj(x).view(x.shape[0], -1)


class PatchMerger(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.width = config.embed_dim * config.spatial_merge_size ** 2
        self.ln_q = nn.LayerNorm(config.embed_dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, config.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class Qwen2VisionTransformer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.merge = config.spatial_merge_size
        self.patch_embed = PatchEmbed(config.in_channels, config.temporal_patch_size, config.patch_size,
                                      config.embed_dim)
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        self.rotary = VisionRotary(config.embed_dim // config.num_heads, theta)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)

    def forward(self, pixels: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        """Language-model embeddings ``[sum(t*h*w) / merge², hidden]`` of the items whose
        flattened patches ``pixels`` are, item after item."""
        frames = [h * w for t, h, w in grids for _ in range(t)]
        rotary = self.rotary(grids, self.merge)
        x = self.patch_embed(pixels)
        for block in self.blocks:
            x = block(x, rotary, frames)
        return self.merger(x)
