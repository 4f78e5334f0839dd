"""http(s) media URLs over real HTTP on 127.0.0.1 (``tests/media_server.py``): the body comes back
whole; a timeout, a body past the size limit, a non-2xx status, a redirect loop, a page that is not
the modality's media and a host outside the allow-list each fail as an InvalidRequestError naming
the URL and the reason, promptly."""

from __future__ import annotations

import re

import pytest
from media_server import media_server

from tokenmill.errors import InvalidRequestError
from tokenmill.multimodal.fetch import MediaFetchPolicy, fetch_media_bytes
from tokenmill.multimodal.media import load_image_url

POLICY = MediaFetchPolicy(timeout=0.5, max_bytes=1 << 20)
REFUSED_HOST = re.escape("'127.0.0.1' is not in --allowed-media-domains")


@pytest.fixture(scope="module")
def media():
    with media_server() as server:
        yield server


def test_an_image_and_a_redirect_to_it_fetch_the_same_bytes(media):
    assert fetch_media_bytes(media.at("/seven.png"), "image", POLICY) == media.png
    assert fetch_media_bytes(media.at("/redirect"), "image", POLICY) == media.png
    assert load_image_url(media.at("/seven.png"), None, POLICY).size == (50, 40)


@pytest.mark.parametrize(("path", "modality", "reason"), [
    ("/slow.png", "image", "no answer within 0.5 s"),
    ("/endless.png", "image", "larger than 1048576 bytes"),
    ("/missing.png", "image", "HTTP 404"),
    ("/loop", "image", "more than 3 redirects"),
    ("/page.html", "image", "content type is 'text/html', not an image"),
    ("/seven.png", "video", "content type is 'image/png', not a video"),
])
def test_a_bad_url_is_refused_naming_it_and_the_reason(media, path, modality, reason):
    with pytest.raises(InvalidRequestError) as caught:
        fetch_media_bytes(media.at(path), modality, POLICY)
    assert media.at(path) in str(caught.value) and reason in str(caught.value)


def test_the_allow_list_checks_the_first_host_and_every_redirect(media):
    only_localhost = MediaFetchPolicy(timeout=0.5, allowed_domains=("localhost",))
    assert fetch_media_bytes(media.at("/seven.png", host="localhost"), "image", only_localhost) == media.png
    with pytest.raises(InvalidRequestError, match=REFUSED_HOST):
        fetch_media_bytes(media.at("/seven.png"), "image", only_localhost)
    with pytest.raises(InvalidRequestError, match=REFUSED_HOST):
        fetch_media_bytes(media.at("/elsewhere", host="localhost"), "image", only_localhost)


def test_the_default_timeouts_are_vllms_environment_variables(monkeypatch):
    monkeypatch.delenv("VLLM_IMAGE_FETCH_TIMEOUT", raising=False)
    monkeypatch.setenv("VLLM_VIDEO_FETCH_TIMEOUT", "12.5")
    policy = MediaFetchPolicy()
    assert (policy.timeout_for("image"), policy.timeout_for("video")) == (5.0, 12.5)
    assert MediaFetchPolicy(timeout=2).timeout_for("video") == 2
