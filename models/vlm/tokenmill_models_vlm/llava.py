"""LLaVA: a CLIP vision tower, a two-layer projector, and a language model.

Each image becomes the projected hidden states of its patches (without the class token
under the ``default`` feature strategy), one per ``<image>`` token the processor put in
the prompt. The language model is the one registered for the text config's architecture
(:mod:`.language_model`); the runner hands it the merged embeddings.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from tokenmill.layers import ModelBuildContext
from tokenmill_models_vlm.clip import ACTIVATIONS, CLIPVisionTower
from tokenmill_models_vlm.composite_weights import load_composite_weights
from tokenmill_models_vlm.language_model import build_language_model
from tokenmill_models_vlm.vision_language_model import VisionLanguageModel

# transformers 5 names (model.vision_tower...) -> the checkpoint names this model uses
_RENAMES = (("model.language_model.", "language_model.model."), ("model.vision_tower.", "vision_tower."),
            ("model.multi_modal_projector.", "multi_modal_projector."), ("lm_head.", "language_model.lm_head."))


class LlavaProjector(nn.Module):
    def __init__(self, config: Any, vision_dim: int) -> None:
        super().__init__()
        bias = getattr(config, "multimodal_projector_bias", True)
        text_dim = config.text_config.hidden_size
        self.linear_1 = nn.Linear(vision_dim, text_dim, bias=bias)
        self.linear_2 = nn.Linear(text_dim, text_dim, bias=bias)
        self.act = ACTIVATIONS[config.projector_hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(VisionLanguageModel):
    supports_pipeline_parallel: ClassVar[bool] = False

    def __init__(self, config: Any, *, ctx: ModelBuildContext) -> None:
        super().__init__()
        self.config = config
        layers = config.vision_feature_layer
        feature_layers = [layers] if isinstance(layers, int) else list(layers)
        if config.vision_feature_select_strategy not in ("default", "full"):
            raise ValueError(f"unknown vision_feature_select_strategy {config.vision_feature_select_strategy!r}")
        self.drops_class_token = config.vision_feature_select_strategy == "default"
        self.vision_tower = CLIPVisionTower(config.vision_config, feature_layers)
        self.multi_modal_projector = LlavaProjector(config, config.vision_config.hidden_size * len(feature_layers))
        self.language_model: Any = build_language_model(config.text_config, ctx.child("language_model"))

    # -- the multimodal model interface (tokenmill.worker.model_interface.MultiModalCausalLM) --
    def embed_multimodal(self, items: list[Any]) -> list[torch.Tensor]:
        """Each image's projected patch features ``[patches, hidden]``; images of one size
        go through the tower together."""
        pixels = torch.cat([item.data["pixel_values"] for item in items]).to(self.multi_modal_projector.linear_1.weight)
        states = self.vision_tower(pixels)
        if self.drops_class_token:
            states = [s[:, 1:] for s in states]
        features = self.multi_modal_projector(torch.cat(states, dim=-1))
        return list(features.unbind(0))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The language model's tensors go to its own ``load_weights``; the tower's and the
        projector's load here (the tower's unused layers are skipped)."""
        unused = tuple(f"vision_tower.{p}" for p in self.vision_tower.unused_prefixes)
        return load_composite_weights(self, self.language_model, weights, _canonical, skipped=unused)


def _canonical(name: str) -> str:
    """A checkpoint name in the legacy layout (``language_model.model...``, ``vision_tower...``)."""
    for old, new in _RENAMES:
        if name.startswith(old):
            name = new + name.removeprefix(old)
            break
    return name.replace("vision_tower.vision_model.", "vision_tower.")
