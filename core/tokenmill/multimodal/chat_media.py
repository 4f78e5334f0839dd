"""OpenAI chat content parts with images: each ``image_url`` part becomes the model's
placeholder text (which the processor then expands) and its image is loaded, in order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenmill.errors import InvalidRequestError
from tokenmill.multimodal.media import load_image_url

IMAGE_PART_TYPES = ("image_url", "input_image")


def take_images(messages: Sequence[dict[str, Any]], placeholder: str | None,
                allowed_local_media_path: str | None) -> tuple[list[dict[str, Any]], list[Any]]:
    """The messages with their image parts replaced by ``placeholder`` text parts, and the
    images. ``placeholder`` None: the model takes no images, so an image part is refused."""
    images: list[Any] = []
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                    if placeholder is None:
                        raise InvalidRequestError("this model takes no images: only text content parts",
                                                  param="messages")
                    images.append(load_image_url(_url(part), allowed_local_media_path))
                    part = {"type": "text", "text": placeholder}
                parts.append(part)
            message = {**message, "content": parts}
        out.append(message)
    return out, images


def _url(part: dict[str, Any]) -> str:
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise InvalidRequestError("an image_url content part needs image_url.url", param="messages")
    return url
