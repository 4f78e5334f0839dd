"""The CLIP vision transformer, as LLaVA uses it: the hidden states of one (or several)
of its layers, never its pooled output.

Bidirectional attention over one image's patches (and its class token), so the
tower needs no KV cache and no attention backend: one ``scaled_dot_product_attention``
over a batch of same-sized images.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        dim = config.hidden_size
        self.patch_embedding = nn.Conv2d(config.num_channels, dim, kernel_size=config.patch_size,
                                         stride=config.patch_size, bias=False)
        self.class_embedding = nn.Parameter(torch.empty(dim))
        num_positions = (config.image_size // config.patch_size) ** 2 + 1
        self.position_embedding = nn.Embedding(num_positions, dim)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)  # [images, patches, dim]
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_size = dim // self.num_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        images, tokens, dim = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(images, tokens, self.num_heads, self.head_size).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)))
        return self.out_proj(out.transpose(1, 2).reshape(images, tokens, dim))


class CLIPMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.self_attn = CLIPAttention(config)
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = CLIPMLP(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, config: Any, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(config) for _ in range(num_layers))


class CLIPVisionTower(nn.Module):
    """Builds only the layers up to the deepest one whose hidden states are read
    (``feature_layers``, indices into the embeddings-then-every-layer list, negative from
    its end, as transformers' ``hidden_states``); the tensors of the later layers and of
    the post-layernorm are not needed (:attr:`unused_prefixes`)."""

    def __init__(self, config: Any, feature_layers: list[int]) -> None:
        super().__init__()
        total = config.num_hidden_layers
        self.feature_layers = [layer if layer >= 0 else total + 1 + layer for layer in feature_layers]
        depth = max(self.feature_layers)
        self.embeddings = CLIPVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)  # sic: the checkpoint's name
        self.encoder = CLIPEncoder(config, depth)
        self.unused_prefixes = ("post_layernorm.", *(f"encoder.layers.{i}." for i in range(depth, total)))

    def forward(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """The hidden states ``[images, 1 + patches, dim]`` of each feature layer."""
        hidden = self.pre_layrnorm(self.embeddings(pixel_values))
        states = [hidden]
        for layer in self.encoder.layers:
            hidden = layer(hidden)
            states.append(hidden)
        return [states[i] for i in self.feature_layers]
