"""Images (and video files) from what an API request sends: ``data:`` URLs (base64), ``file://`` paths
under the one folder the server allows (``allowed_local_media_path``) and ``http(s)://`` URLs
(fetched under a :class:`~tokenmill.multimodal.fetch.MediaFetchPolicy`).

Every failure is an :class:`InvalidRequestError` that says what was wrong with the input
(a 400 from the server), never an exception from deep inside Pillow.
"""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from tokenmill.errors import InvalidRequestError
from tokenmill.multimodal.fetch import MediaFetchPolicy, fetch_media_bytes, is_http_url

_PARAM = "messages"


def load_image_url(url: str, allowed_local_media_path: str | None = None,
                   fetch_policy: MediaFetchPolicy | None = None) -> Any:
    """The RGB ``PIL.Image`` at ``url``."""
    if url.startswith("data:"):
        return image_from_bytes(_data_url_bytes(url))
    if url.startswith("file:"):
        return image_from_bytes(_local_file_bytes(url, allowed_local_media_path))
    if is_http_url(url):
        return image_from_bytes(fetch_media_bytes(url, "image", fetch_policy or MediaFetchPolicy()))
    scheme = url.split(":", 1)[0] if ":" in url else "(none)"
    raise InvalidRequestError(f"image URL scheme {scheme!r} is not supported: send a data: URL (base64), an http(s) "
                              "URL or a file:// path under --allowed-local-media-path", param=_PARAM)


def load_video_url(url: str, allowed_local_media_path: str | None = None,
                   fetch_policy: MediaFetchPolicy | None = None) -> bytes:
    """The bytes of the video file at ``url`` (decoded by the model's processor)."""
    if url.startswith("data:"):
        return _data_url_bytes(url)
    if url.startswith("file:"):
        return _local_file_bytes(url, allowed_local_media_path)
    if is_http_url(url):
        return fetch_media_bytes(url, "video", fetch_policy or MediaFetchPolicy())
    scheme = url.split(":", 1)[0] if ":" in url else "(none)"
    raise InvalidRequestError(f"video URL scheme {scheme!r} is not supported: send a data: URL (base64), an http(s) "
                              "URL or a file:// path under --allowed-local-media-path", param=_PARAM)


def image_from_bytes(data: bytes) -> Any:
    """Decode ``data`` with Pillow, fully (a truncated file fails here, not in the processor)."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError as exc:  # pragma: no cover - pillow comes with every multimodal model plugin
        raise InvalidRequestError("images need Pillow installed (pip install pillow)", param=_PARAM) from exc
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except UnidentifiedImageError as exc:
        raise InvalidRequestError("the image data is not in an image format this server reads (or is corrupt)",
                                  param=_PARAM) from exc
    except (OSError, ValueError, SyntaxError) as exc:  # truncated or damaged data
        raise InvalidRequestError(f"the image data is corrupt: {exc}", param=_PARAM) from exc
    return image.convert("RGB")


def _data_url_bytes(url: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise InvalidRequestError("an image data: URL must be base64 (data:image/png;base64,...)", param=_PARAM)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequestError("the image data: URL holds invalid base64", param=_PARAM) from exc


def _local_file_bytes(url: str, allowed: str | None) -> bytes:
    if allowed is None:
        raise InvalidRequestError("file:// image URLs are refused: the server allows no local folder "
                                  "(--allowed-local-media-path)", param=_PARAM)
    path = Path(unquote(urlparse(url).path)).resolve()
    root = Path(allowed).resolve()
    if not path.is_relative_to(root):
        raise InvalidRequestError(f"the file {path} is outside the allowed folder (--allowed-local-media-path)",
                                  param=_PARAM)
    try:
        return path.read_bytes()
    except OSError as exc:
        raise InvalidRequestError(f"the image file {path} cannot be read: {exc.strerror}", param=_PARAM) from exc
