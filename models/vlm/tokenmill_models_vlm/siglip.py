"""The SigLIP vision transformer, as Gemma 3 uses it: the last layer's hidden states after the
post-layernorm (its ``last_hidden_state``), never the attention-pooling head.

Its encoder layers are CLIP's (the same attention, MLP and norms, under the same names), so
they come from :mod:`.clip`; SigLIP differs in front of them: no class token, no
pre-layernorm, a patch convolution with a bias.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill_models_vlm.clip import CLIPEncoder


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        dim = config.hidden_size
        self.patch_embedding = nn.Conv2d(config.num_channels, dim, kernel_size=config.patch_size,
                                         stride=config.patch_size)
        self.position_embedding = nn.Embedding((config.image_size // config.patch_size) ** 2, dim)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        return patches.flatten(2).transpose(1, 2) + self.position_embedding.weight  # [images, patches, dim]


class SiglipVisionTower(nn.Module):
    """Images of the config's size only (the processor resizes to it): the position embeddings
    are not interpolated. The pooling head's tensors, where a checkpoint has them, are not
    needed (:attr:`unused_prefixes`)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.embeddings = SiglipVisionEmbeddings(config)
        self.encoder = CLIPEncoder(config, config.num_hidden_layers)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.unused_prefixes = ("head.",)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[images, patches, dim]``: the post-layernormed last hidden states."""
        hidden = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            hidden = layer(hidden)
        return self.post_layernorm(hidden)
