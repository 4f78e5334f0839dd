"""Media over the network: an ``http(s)://`` image or video URL fetched with a time limit, a
size limit and an optional allow-list of domains (:class:`MediaFetchPolicy`).

The body is streamed and the download stops as soon as it passes ``max_bytes``, so a huge or
endless body never sits in memory. Redirects are followed a few hops, each hop's host checked
against the allow-list. Every failure (refused domain, non-2xx status, timeout, too large, a
body that is not the modality's media) is an :class:`InvalidRequestError` naming the URL and
the reason: a 400 from the server, never a hang or a 500.

The fetch blocks its thread: callers run it off the event loop (the server prepares chat
prompts on a worker thread) and never on the engine's step loop.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import httpx

from tokenmill.errors import InvalidRequestError

_PARAM = "messages"
MAX_REDIRECTS = 3
# vLLM's environment variables for the fetch time limits, and their defaults (seconds)
TIMEOUT_ENV = {"image": ("VLLM_IMAGE_FETCH_TIMEOUT", 5.0), "video": ("VLLM_VIDEO_FETCH_TIMEOUT", 30.0)}
# content types that do not say what the bytes are: the decoder decides
_UNTYPED = ("application/octet-stream", "binary/octet-stream", "")


@dataclass(frozen=True)
class MediaFetchPolicy:
    """How media URLs may be fetched: ``timeout`` None takes the modality's default (the
    VLLM_*_FETCH_TIMEOUT environment variable or 5 s for images, 30 s for videos);
    ``allowed_domains`` empty lets any host through."""

    timeout: float | None = None
    max_bytes: int = 64 << 20
    allowed_domains: tuple[str, ...] = ()

    def timeout_for(self, modality: str) -> float:
        if self.timeout is not None:
            return self.timeout
        env, default = TIMEOUT_ENV[modality]
        return float(os.environ.get(env, default))


def is_http_url(url: str) -> bool:
    return url.split(":", 1)[0].lower() in ("http", "https")


def fetch_media_bytes(url: str, modality: str, policy: MediaFetchPolicy) -> bytes:
    """The body at ``url``, at most ``policy.max_bytes`` of it, within the modality's time limit."""
    timeout = policy.timeout_for(modality)
    deadline = time.monotonic() + timeout

    def check_host(request: httpx.Request) -> None:  # the first URL and every redirect's target
        _check_domain(url, request.url.host, policy.allowed_domains)

    try:
        with httpx.Client(timeout=timeout, follow_redirects=True, max_redirects=MAX_REDIRECTS,
                          event_hooks={"request": [check_host]}) as client:
            with client.stream("GET", url) as response:
                if not response.is_success:
                    raise _refused(url, f"the server answered HTTP {response.status_code}")
                _check_content_type(url, response.headers.get("content-type", ""), modality)
                return _bounded_body(url, response, policy.max_bytes, deadline)
    except httpx.TimeoutException as exc:
        raise _refused(url, f"no answer within {timeout:g} s (--media-fetch-timeout)") from exc
    except httpx.TooManyRedirects as exc:
        raise _refused(url, f"more than {MAX_REDIRECTS} redirects") from exc
    except httpx.InvalidURL as exc:
        raise _refused(url, f"the URL is malformed: {exc}") from exc
    except httpx.HTTPError as exc:  # connection refused, DNS, protocol errors
        raise _refused(url, f"it could not be fetched: {exc}") from exc


def _bounded_body(url: str, response: httpx.Response, max_bytes: int, deadline: float) -> bytes:
    declared = response.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(url, max_bytes)
    chunks, size = [], 0
    for chunk in response.iter_bytes():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(url, max_bytes)
        if time.monotonic() > deadline:  # a body that trickles in under the per-read limit
            raise httpx.ReadTimeout("the download took too long", request=response.request)
        chunks.append(chunk)
    return b"".join(chunks)


def _check_domain(url: str, host: str, allowed: tuple[str, ...]) -> None:
    if allowed and host.lower() not in {d.lower() for d in allowed}:
        raise _refused(url, f"the domain {host!r} is not in --allowed-media-domains")


def _check_content_type(url: str, content_type: str, modality: str) -> None:
    kind = content_type.split(";", 1)[0].strip().lower()
    if kind in _UNTYPED or kind.startswith(f"{modality}/"):
        return
    raise _refused(url, f"its content type is {kind!r}, not an {modality}" if modality == "image"
                   else f"its content type is {kind!r}, not a {modality}")


def _too_large(url: str, max_bytes: int) -> InvalidRequestError:
    return _refused(url, f"the body is larger than {max_bytes} bytes (--max-media-bytes)")


def _refused(url: str, reason: str) -> InvalidRequestError:
    shown = url if len(url) <= 200 else url[:200] + "..."
    return InvalidRequestError(f"the media URL {shown} was refused: {reason}", param=_PARAM)
