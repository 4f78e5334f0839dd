"""Qwen2-VL: a vision transformer with a patch merger in front of a Qwen2 language model
whose rotary positions have three sections (M-RoPE: temporal, height, width).

Each image (or video) becomes ``t * h * w / merge²`` tokens, its size decided by the
processor (dynamic resolution: :mod:`.qwen2_vl_processor`). The language model is the
registered ``Qwen2ForCausalLM`` (its rotary layer is :class:`tokenmill.layers.MRotaryEmbedding`,
chosen by the config's ``mrope_section``); the runner hands it the M-RoPE positions this
model computes for each prompt (:meth:`mrope_prompt_positions`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from tokenmill.layers import ModelBuildContext, MRopeItem, mrope_prompt_positions
from tokenmill_models_vlm.composite_weights import load_composite_weights
from tokenmill_models_vlm.language_model import build_language_model
from tokenmill_models_vlm.qwen2_5_vision import Qwen2_5VisionTransformer
from tokenmill_models_vlm.qwen2_vision import Qwen2VisionTransformer
from tokenmill_models_vlm.vision_language_model import VisionLanguageModel

# transformers 5 names first, then the original checkpoints' (visual.*, model.*, lm_head)
_RENAMES = (("model.language_model.", "language_model.model."), ("model.visual.", "visual."),
            ("model.", "language_model.model."), ("lm_head.", "language_model.lm_head."))
# The tensor names an item's processor output uses, by modality.
PIXELS = {"image": "pixel_values", "video": "pixel_values_videos"}
GRIDS = {"image": "image_grid_thw", "video": "video_grid_thw"}


class Qwen2VLForConditionalGeneration(VisionLanguageModel):
    supports_pipeline_parallel: ClassVar[bool] = False
    text_architecture: ClassVar[str] = "Qwen2ForCausalLM"

    def __init__(self, config: Any, *, ctx: ModelBuildContext) -> None:
        super().__init__()
        self.config = config
        self.merge = config.vision_config.spatial_merge_size
        self.visual = self.build_vision(config.vision_config)
        text_config = copy.copy(config.text_config)
        text_config.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.language_model: Any = build_language_model(text_config, ctx.child("language_model"),
                                                        architecture=self.text_architecture)

    @staticmethod
    def build_vision(vision_config: Any) -> nn.Module:
        return Qwen2VisionTransformer(vision_config)

    # -- the multimodal model interface (tokenmill.worker.model_interface.MultiModalCausalLM) --
    def embed_multimodal(self, items: list[Any]) -> list[torch.Tensor]:
        """Each item's merged patch features ``[t*h*w / merge², hidden]``; all of them go
        through the tower at once (attention stays within each frame)."""
        grids = [self._grid(item) for item in items]
        pixels = torch.cat([item.data[PIXELS[item.modality]] for item in items])
        features = self.visual(pixels, grids)
        return list(features.split([t * h * w // self.merge ** 2 for t, h, w in grids]))

    def mrope_prompt_positions(self, prompt_token_ids: list[int], items: list[Any]) -> tuple[np.ndarray, int]:
        """The prompt's M-RoPE positions ``[3, P]`` and the decode offset (transformers'
        ``get_rope_index``): each item spans its grid after the merge."""
        placed = []
        for item in items:
            t, h, w = self._grid(item)
            placed.append(MRopeItem(item.offset, t, h // self.merge, w // self.merge, self._time_interval(item)))
        return mrope_prompt_positions(len(prompt_token_ids), placed)

    def _time_interval(self, item: Any) -> float:
        """How far apart an item's temporal positions are: one per temporal patch in Qwen2-VL."""
        return 1.0

    @staticmethod
    def _grid(item: Any) -> tuple[int, int, int]:
        t, h, w = (int(v) for v in item.data[GRIDS[item.modality]].reshape(3).tolist())
        return t, h, w

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The language model's tensors go to its own ``load_weights``; the tower's load here."""
        return load_composite_weights(self, self.language_model, weights, _canonical)


def _canonical(name: str) -> str:
    """A checkpoint name in this model's layout (``visual.``, ``language_model.model.``, ...)."""
    for old, new in _RENAMES:
        if name.startswith(old):
            return new + name.removeprefix(old)
    return name


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL: the same language model and M-RoPE; a vision transformer with window
    attention (:mod:`.qwen2_5_vision`); a video's temporal positions spaced by its time
    (``tokens_per_second`` positions a second, ``second_per_grid_ts`` seconds a temporal patch)."""

    @staticmethod
    def build_vision(vision_config: Any) -> nn.Module:
        return Qwen2_5VisionTransformer(vision_config)

    def _time_interval(self, item: Any) -> float:
        if item.modality != "video":
            return 1.0
        seconds = float(item.data["second_per_grid_ts"].reshape(-1)[0])
        return seconds * float(self.config.vision_config.tokens_per_second)
