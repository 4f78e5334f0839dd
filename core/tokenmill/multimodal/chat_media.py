"""OpenAI chat content parts with images (and videos): each ``image_url`` (``video_url``) part
becomes the model's placeholder text (which the processor then expands) and its image (the
video file's bytes) is loaded, in order."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenmill.errors import InvalidRequestError
from tokenmill.multimodal.fetch import MediaFetchPolicy, is_http_url
from tokenmill.multimodal.media import load_image_url, load_video_url

IMAGE_PART_TYPES = ("image_url", "input_image")
VIDEO_PART_TYPES = ("video_url",)


def take_images(messages: Sequence[dict[str, Any]], placeholder: str | None,
                allowed_local_media_path: str | None) -> tuple[list[dict[str, Any]], list[Any]]:
    """The messages with their image parts replaced by ``placeholder`` text parts, and the
    images. ``placeholder`` None: the model takes no images, so an image part is refused."""
    out, media = take_media(messages, {"image": placeholder}, allowed_local_media_path)
    return out, media["image"]


def take_media(messages: Sequence[dict[str, Any]], placeholders: Mapping[str, str | None],
               allowed_local_media_path: str | None, fetch_policy: MediaFetchPolicy | None = None,
               ) -> tuple[list[dict[str, Any]], dict[str, list[Any]]]:
    """The messages with their image and video parts replaced by the placeholder text of
    their modality, and the items of each modality (images, videos' file bytes), in order.
    A modality whose placeholder is None or absent is one the model does not take: its parts
    are refused. An http(s) URL is fetched here, blocking: call it off any event loop."""
    media: dict[str, list[Any]] = {"image": [], "video": []}
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                modality = _modality(part)
                if modality is not None:
                    placeholder = placeholders.get(modality)
                    if placeholder is None:
                        raise InvalidRequestError(f"this model takes no {modality}s: only "
                                                  f"{_accepted(placeholders)} content parts", param="messages")
                    load = load_image_url if modality == "image" else load_video_url
                    media[modality].append(load(_url(part, modality), allowed_local_media_path,
                                                      fetch_policy))
                    part = {"type": "text", "text": placeholder}
                parts.append(part)
            message = {**message, "content": parts}
        out.append(message)
    return out, media


def names_remote_media(message: Mapping[str, Any]) -> bool:
    """Whether ``message`` has an image or video part whose URL is fetched over http(s)."""
    content = message.get("content")
    if not isinstance(content, list):
        return False
    for part in content:
        modality = _modality(part)
        if modality is not None:
            value = part.get(f"{modality}_url")
            url = value.get("url") if isinstance(value, dict) else value
            if isinstance(url, str) and is_http_url(url):
                return True
    return False


def media_placeholders(processor: Any) -> dict[str, str | None]:
    """The chat text of one item of each modality for a multimodal ``processor`` (None: a
    text model, which takes neither)."""
    return {"image": getattr(processor, "image_placeholder", None), "video": getattr(processor, "video_placeholder", None)}


def _modality(part: Any) -> str | None:
    if not isinstance(part, dict):
        return None
    kind = part.get("type")
    return "image" if kind in IMAGE_PART_TYPES else "video" if kind in VIDEO_PART_TYPES else None


def _accepted(placeholders: Mapping[str, str | None]) -> str:
    return " and ".join(["text", *(m for m, p in placeholders.items() if p is not None)])


def _url(part: dict[str, Any], modality: str = "image") -> str:
    value = part.get(f"{modality}_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise InvalidRequestError(f"a {modality}_url content part needs {modality}_url.url", param="messages")
    return url
