"""The engine side of multimodal inputs: the model's own Hugging Face processor turns a prompt
and its images into token ids (each placeholder expanded to the image's tokens) and one
:class:`MultiModalItem` per image, recording where its tokens sit."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from tokenmill.errors import InvalidRequestError
from tokenmill.multimodal.inputs import MultiModalItem, content_hash

MODALITIES = ("image",)
# The processor's outputs that describe the text, not an item.
_TEXT_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"})


class MultiModalProcessor:
    """Wraps ``AutoProcessor`` from the model folder (the pure-Python image processors:
    torchvision is not needed). ``limits``: the most items of each modality one prompt may
    carry (``limit_mm_per_prompt``); a modality not named there has no limit but the context.
    """

    def __init__(self, folder: str | Path, hf_config: Any, limits: Mapping[str, int] | None = None) -> None:
        from transformers import AutoProcessor

        self.hf_processor = AutoProcessor.from_pretrained(folder, backend="pil")
        token_id = getattr(hf_config, "image_token_id", None)
        if token_id is None:
            token_id = getattr(hf_config, "image_token_index", None)
        if token_id is None:
            raise ValueError("a multimodal model's config names no image_token_id")
        self.image_token_id = int(token_id)
        self.image_placeholder: str = self.hf_processor.image_token
        self.limits = dict(limits or {})

    def process(self, text: str, mm_data: Mapping[str, Any], options: Mapping[str, Any] | None = None,
                add_special_tokens: bool = True) -> tuple[list[int], list[MultiModalItem]]:
        """Token ids of ``text`` with every placeholder expanded, and the items in prompt order.
        ``options``: the processor's keyword arguments (``mm_processor_kwargs``), part of each
        item's hash; ``add_special_tokens`` False for a text a chat template rendered (it wrote
        them). Raises :class:`InvalidRequestError` naming what is wrong with the input."""
        options = dict(options or {})
        unknown = sorted(set(mm_data) - set(MODALITIES))
        if unknown:
            raise InvalidRequestError(f"this model takes {list(MODALITIES)} inputs, not {unknown}",
                                      param="multi_modal_data")
        images = _as_images(mm_data.get("image"))
        self._check_counts(text, images)
        try:
            out = self.hf_processor(text=text, images=images or None, return_tensors="pt",
                                    add_special_tokens=add_special_tokens, **options)
        except (ValueError, TypeError, OSError, KeyError) as exc:
            raise InvalidRequestError(f"the model's processor rejected the input: {exc}",
                                      param="multi_modal_data") from exc
        token_ids = [int(t) for t in out["input_ids"][0].tolist()]
        lengths = self._token_counts(images, options)
        spans = _placeholder_spans(token_ids, self.image_token_id, lengths)
        tensors = _split_per_item({k: v for k, v in out.items() if k not in _TEXT_KEYS}, len(images))
        items = [MultiModalItem("image", offset, length, content_hash("image", data, options), data)
                 for (offset, length), data in zip(spans, tensors, strict=True)]
        return token_ids, items

    def _check_counts(self, text: str, images: list[Any]) -> None:
        limit = self.limits.get("image")
        if limit is not None and len(images) > limit:
            raise InvalidRequestError(f"the prompt has {len(images)} images, more than this engine's "
                                      f"limit_mm_per_prompt of {limit} per prompt", param="multi_modal_data")
        placeholders = text.count(self.image_placeholder)
        if placeholders != len(images):
            raise InvalidRequestError(
                f"the prompt has {placeholders} image placeholder(s) {self.image_placeholder!r} but "
                f"{len(images)} image(s) were given: each image needs one placeholder", param="multi_modal_data")

    def _token_counts(self, images: list[Any], options: Mapping[str, Any]) -> list[int]:
        sizes = [(image.height, image.width) for image in images]
        counts = self.hf_processor._get_num_multimodal_tokens(image_sizes=sizes, **options).num_image_tokens
        return [int(c) for c in counts or []]


def _as_images(value: Any) -> list[Any]:
    """The images of a prompt as a list of RGB PIL images; anything else is refused by name."""
    if value is None:
        return []
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    try:
        from PIL import Image
    except ImportError as exc:  # pragma: no cover - pillow comes with every multimodal model plugin
        raise InvalidRequestError("images need Pillow installed (pip install pillow)") from exc
    for item in values:
        if not isinstance(item, Image.Image):
            raise InvalidRequestError(f"an image is a PIL.Image, not {type(item).__name__}", param="multi_modal_data")
    return [item if item.mode == "RGB" else item.convert("RGB") for item in values]


def _placeholder_spans(token_ids: list[int], token_id: int, lengths: Sequence[int]) -> list[tuple[int, int]]:
    """``(offset, length)`` of each item's run of placeholder tokens, in order. Adjacent
    images make one run of tokens, so the run is cut by the lengths the processor says."""
    spans, position = [], 0
    for length in lengths:
        try:
            offset = token_ids.index(token_id, position)
        except ValueError:
            raise InvalidRequestError("the processed prompt holds fewer image tokens than its images need",
                                      param="multi_modal_data") from None
        if token_ids[offset:offset + length] != [token_id] * length:
            raise InvalidRequestError(f"an image needs {length} tokens where the processed prompt holds fewer",
                                      param="multi_modal_data")
        spans.append((offset, length))
        position = offset + length
    if token_id in token_ids[position:]:
        raise InvalidRequestError("the prompt holds image tokens that no image fills (a literal image token?)",
                                  param="prompt")
    return spans


def _split_per_item(tensors: Mapping[str, Any], count: int) -> list[dict[str, torch.Tensor]]:
    """The processor's batch tensors cut into one dict per item (each keeps a leading dim of 1)."""
    items: list[dict[str, torch.Tensor]] = [{} for _ in range(count)]
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor) or value.shape[0] != count:
            raise InvalidRequestError(f"the processor's {name!r} output cannot be split per image",
                                      param="multi_modal_data")
        for i in range(count):
            items[i][name] = value[i:i + 1]
    return items
