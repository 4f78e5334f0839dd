"""Gemma 3 with images: a SigLIP vision tower, Gemma 3's projector, and the Gemma 3 text decoder.

Each image (resized by the processor to the tower's size) becomes ``mm_tokens_per_image`` rows:
the tower's patch grid average-pooled down to a ``sqrt(mm_tokens_per_image)`` square, normed
(an RMSNorm scaled by ``1 + w``) and projected to the text width. The processor writes each
image as ``\\n\\n<start_of_image>`` + that many image tokens + ``<end_of_image>\\n\\n``; the
image tokens take the rows (unscaled, where a text token's embedding is scaled by
``sqrt(hidden)``).

In the language model an image's tokens attend to each other both ways (transformers' mask
from ``token_type_ids``): the class says so with :attr:`attends_within_items`, and the engine
then computes every image whole in one step and has the attention layers see the whole image
(``tokenmill.attention.item_blocks``). The decoder is the one the Gemma plugin registers for
``Gemma3ForCausalLM`` (:mod:`.language_model`); no layer is copied here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from tokenmill.layers import ModelBuildContext
from tokenmill_models_vlm.composite_weights import load_composite_weights
from tokenmill_models_vlm.language_model import build_language_model
from tokenmill_models_vlm.llava import _canonical as legacy_name
from tokenmill_models_vlm.siglip import SiglipVisionTower
from tokenmill_models_vlm.vision_language_model import VisionLanguageModel


class Gemma3SoftEmbeddingNorm(nn.Module):
    """RMSNorm by ``1 + w`` in float32, as transformers' Gemma3RMSNorm (the checkpoint's ``w``
    kept as it is: the vision side is small and stays in torch)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class Gemma3MultiModalProjector(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        vision = config.vision_config
        self.patches_per_side = vision.image_size // vision.patch_size
        tokens_per_side = int(config.mm_tokens_per_image ** 0.5)
        if tokens_per_side ** 2 != config.mm_tokens_per_image or self.patches_per_side % tokens_per_side:
            raise ValueError(f"mm_tokens_per_image {config.mm_tokens_per_image} is not a square that divides the "
                             f"{self.patches_per_side}x{self.patches_per_side} patch grid")
        self.pool = nn.AvgPool2d(self.patches_per_side // tokens_per_side)
        self.mm_soft_emb_norm = Gemma3SoftEmbeddingNorm(vision.hidden_size, vision.layer_norm_eps)
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vision.hidden_size,
                                                                   config.text_config.hidden_size))

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """``[images, patches, vision dim]`` -> ``[images, mm_tokens_per_image, text dim]``."""
        images, _, dim = patches.shape
        grid = patches.transpose(1, 2).reshape(images, dim, self.patches_per_side, self.patches_per_side)
        pooled = self.pool(grid.contiguous()).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).type_as(patches)


class Gemma3ForConditionalGeneration(VisionLanguageModel):
    supports_pipeline_parallel: ClassVar[bool] = False
    # An image's tokens attend to each other both ways (read by the runner; the plugin's ModelSpec
    # says "whole_mm_items" for the scheduler).
    attends_within_items: ClassVar[bool] = True

    def __init__(self, config: Any, *, ctx: ModelBuildContext) -> None:
        super().__init__()
        self.config = config
        self.vision_tower = SiglipVisionTower(config.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(config)
        self.language_model: Any = build_language_model(config.text_config, ctx.child("language_model"))

    # -- the multimodal model interface (tokenmill.worker.model_interface.MultiModalCausalLM) --
    def embed_multimodal(self, items: list[Any]) -> list[torch.Tensor]:
        """Each image's ``[mm_tokens_per_image, hidden]`` rows; the images go through the tower
        together (the processor gives them all one size)."""
        weight = self.multi_modal_projector.mm_input_projection_weight
        pixels = torch.cat([item.data["pixel_values"] for item in items]).to(weight)
        return list(self.multi_modal_projector(self.vision_tower(pixels)).unbind(0))

    def embed_text_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The text tokens' scaled embeddings (the image rows stay as they are, as transformers merges them)."""
        return self.language_model.model.embed_input_ids(input_ids)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The language model's tensors go to its own ``load_weights``; the tower's and the
        projector's load here (a SigLIP pooling head, unused, is skipped)."""
        unused = tuple(f"vision_tower.{p}" for p in self.vision_tower.unused_prefixes)
        return load_composite_weights(self, self.language_model, weights, legacy_name, skipped=unused)
