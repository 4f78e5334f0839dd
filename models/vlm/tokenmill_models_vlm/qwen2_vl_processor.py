"""Qwen2-VL's input processor: transformers' own image processor (``Qwen2VLImageProcessor``
from ``preprocessor_config.json``) makes each image's patches at its own resolution, and
each ``<|image_pad|>`` (``<|video_pad|>``) token of the prompt becomes as many tokens as the
item's grid holds after the merge, as transformers' ``Qwen2VLProcessor`` expands them.

transformers' processor class is not used: it needs its video processor, which needs
torchvision. Videos are decoded and patched here (:mod:`.video`) from the same image
processor's per-frame resize and normalisation.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenmill.plugin_api import InvalidRequestError, MultiModalItem, content_hash
from tokenmill_models_vlm.video import SAMPLING_DEFAULTS, SAMPLING_OPTIONS, load_video, video_patches

MODALITIES = ("image", "video")
_PARAM = "multi_modal_data"


class Qwen2VLInputProcessor:
    """The interface of ``tokenmill.multimodal.processor.MultiModalProcessor``:
    ``process``, ``image_token_id``, ``image_placeholder`` (the chat text of one image) and
    ``limits`` (``limit_mm_per_prompt``)."""

    def __init__(self, folder: str | Path, hf_config: Any, limits: Mapping[str, int] | None = None) -> None:
        from transformers import AutoImageProcessor, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.image_processor = AutoImageProcessor.from_pretrained(folder, backend="pil")
        self.image_token_id = int(hf_config.image_token_id)
        self.video_token_id = int(hf_config.video_token_id)
        self.token_ids = {"image": self.image_token_id, "video": self.video_token_id}
        self.merge = int(hf_config.vision_config.spatial_merge_size)
        start, end = (self.tokenizer.convert_ids_to_tokens(int(getattr(hf_config, name)))
                      for name in ("vision_start_token_id", "vision_end_token_id"))
        pads = {m: self.tokenizer.convert_ids_to_tokens(t) for m, t in self.token_ids.items()}
        self.placeholders = {m: f"{start}{pad}{end}" for m, pad in pads.items()}  # as Qwen2-VL's chat template writes
        self.image_placeholder = self.placeholders["image"]
        self.video_placeholder = self.placeholders["video"]
        self.limits = dict(limits or {})

    def process(self, text: str, mm_data: Mapping[str, Any], options: Mapping[str, Any] | None = None,
                add_special_tokens: bool = True) -> tuple[list[int], list[MultiModalItem]]:
        """Token ids of ``text`` with every pad token expanded, and the items in prompt order.
        ``options`` (``mm_processor_kwargs``) go to the image processor and into each item's hash."""
        options = dict(options or {})
        unknown = sorted(set(mm_data) - set(MODALITIES))
        if unknown:
            raise InvalidRequestError(f"this model takes {list(MODALITIES)} inputs, not {unknown}", param=_PARAM)
        inputs = {"image": _as_images(mm_data.get("image")), "video": _as_videos(mm_data.get("video"))}
        token_ids = list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
        self._check_counts(token_ids, inputs)
        data = {"image": [self._image(image, options) for image in inputs["image"]],
                "video": [self._video(video, options) for video in inputs["video"]]}
        return self._expand(token_ids, data, options)

    def _check_counts(self, token_ids: list[int], inputs: Mapping[str, list[Any]]) -> None:
        for modality, values in inputs.items():
            limit = self.limits.get(modality)
            if limit is not None and len(values) > limit:
                raise InvalidRequestError(f"the prompt has {len(values)} {modality}s, more than this engine's "
                                          f"limit_mm_per_prompt of {limit} per prompt", param=_PARAM)
            pads = token_ids.count(self.token_ids[modality])
            if pads != len(values):
                raise InvalidRequestError(
                    f"the prompt has {pads} {modality} placeholder(s) {self.placeholders[modality]!r} but "
                    f"{len(values)} {modality}(s) were given: each {modality} needs one placeholder", param=_PARAM)

    def _image(self, image: Any, options: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        from PIL import Image

        if not isinstance(image, Image.Image):
            raise InvalidRequestError(f"an image is a PIL.Image, not {type(image).__name__}", param=_PARAM)
        try:
            out = self.image_processor(images=[image.convert("RGB")], return_tensors="pt", **options)
        except (ValueError, TypeError, OSError, KeyError) as exc:
            raise InvalidRequestError(f"the model's image processor rejected the input: {exc}", param=_PARAM) from exc
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}

    def _video(self, video: Any, options: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        sampling = {k: v for k, v in options.items() if k in SAMPLING_OPTIONS}
        frames = load_video(video, int(self.image_processor.temporal_patch_size), sampling)
        try:
            pixels, grid = video_patches(frames, self.image_processor,
                                         {k: v for k, v in options.items() if k not in SAMPLING_OPTIONS})
        except (ValueError, TypeError, KeyError) as exc:
            raise InvalidRequestError(f"the model's image processor rejected the video: {exc}", param=_PARAM) from exc
        # Qwen2.5-VL spaces a video's temporal positions by its time: seconds per temporal patch at
        # the sampling rate (the processor's fps, 2 unless mm_processor_kwargs say otherwise)
        fps = float(sampling.get("fps", SAMPLING_DEFAULTS["fps"]))
        seconds = torch.tensor([int(self.image_processor.temporal_patch_size) / fps])
        return {"pixel_values_videos": pixels, "video_grid_thw": grid, "second_per_grid_ts": seconds}

    def _expand(self, token_ids: list[int], data: Mapping[str, list[dict[str, torch.Tensor]]],
                options: Mapping[str, Any]) -> tuple[list[int], list[MultiModalItem]]:
        """Each pad token replaced by its item's tokens, walking the prompt in order."""
        modality_of = {t: m for m, t in self.token_ids.items()}
        pending = {m: iter(values) for m, values in data.items()}
        out: list[int] = []
        items = []
        for token in token_ids:
            modality = modality_of.get(token)
            if modality is None:
                out.append(token)
                continue
            tensors = next(pending[modality])
            grid = tensors[f"{modality}_grid_thw"]
            length = int(grid.prod()) // self.merge ** 2
            items.append(MultiModalItem(modality, len(out), length, content_hash(modality, tensors, options), tensors))
            out.extend([token] * length)
        return out, items


def _as_images(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _as_videos(value: Any) -> list[Any]:
    """One video or a list of them. A video given as frames is a list (or a ``[T, H, W, 3]``
    array) itself, so a list of videos is a list of lists, arrays, paths or bytes."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)) and value and _is_video(value[0]):
        return list(value)
    return [value]


def _is_video(value: Any) -> bool:
    return (isinstance(value, (list, tuple, str, bytes, Path))
            or (isinstance(value, np.ndarray) and value.ndim == 4))
