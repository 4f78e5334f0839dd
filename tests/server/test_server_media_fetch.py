"""Chat with http(s) image URLs over real HTTP: `tokenmill serve` (the tiny LLaVA) fetches them from a
local media server on 127.0.0.1 and answers as it does for the same image sent as a data: URL (and
as ``LLM.chat`` does for the same URL); a URL that times out, is too large, is a 404, is not an image,
loops, or names a host outside --allowed-media-domains is a 400 naming it, and the server goes on."""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from conftest import API_KEY
from media_server import media_server
from vlm_models import build_llava

from tokenmill import LLM, SamplingParams

VLM = "tiny-llava"
MAX_MODEL_LEN = 56
GREEDY = dict(model=VLM, temperature=0, max_completion_tokens=6, extra_body={"ignore_eos": True})
FETCH_ARGS = ["--media-fetch-timeout", "1", "--max-media-bytes", "1MiB", "--allowed-media-domains", "127.0.0.1"]


@pytest.fixture(scope="module")
def media():
    with media_server() as server:
        yield server


@pytest.fixture(scope="module")
def llava_path(tmp_path_factory):
    return build_llava(tmp_path_factory.mktemp("llava-fetch"))


@pytest.fixture(scope="module")
def vlm_server(start_server, llava_path):
    return start_server([str(llava_path), "--served-model-name", VLM, "--max-model-len", str(MAX_MODEL_LEN),
                         "--kv-cache-memory", "16MiB", "--dtype", "float32", *FETCH_ARGS],
                        env={"TOKENMILL_API_KEY": API_KEY})


@pytest.fixture(scope="module")
def vlm_client(vlm_server):
    return openai.OpenAI(base_url=f"{vlm_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _user(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "The quick brown fox"}]}]


def _answer(client, url: str) -> str:
    return client.chat.completions.create(messages=_user(url), **GREEDY).choices[0].message.content


def test_an_http_image_answers_as_its_data_url_does(vlm_client, llava_path, media):
    data_url = "data:image/png;base64," + base64.b64encode(media.png).decode()
    fetched, redirected = _answer(vlm_client, media.at("/seven.png")), _answer(vlm_client, media.at("/redirect"))
    assert fetched == redirected == _answer(vlm_client, data_url)
    llm = LLM(str(llava_path), dtype="float32", max_model_len=MAX_MODEL_LEN, max_media_bytes="1MiB")
    out = llm.chat(_user(media.at("/seven.png")), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert out[0].outputs[0].text == fetched


@pytest.mark.parametrize(("path", "host", "reason"), [
    ("/slow.png", "127.0.0.1", "no answer within 1 s"),
    ("/endless.png", "127.0.0.1", "larger than 1048576 bytes"),
    ("/missing.png", "127.0.0.1", "HTTP 404"),
    ("/page.html", "127.0.0.1", "not an image"),
    ("/loop", "127.0.0.1", "redirects"),
    ("/seven.png", "localhost", "not in --allowed-media-domains"),
])
def test_a_bad_http_image_is_a_400_naming_it(vlm_client, media, path, host, reason):
    url = media.at(path, host=host)
    with pytest.raises(openai.BadRequestError) as caught:
        vlm_client.chat.completions.create(messages=_user(url), **GREEDY)
    assert caught.value.status_code == 400
    assert url in str(caught.value) and reason in str(caught.value)
    assert _answer(vlm_client, media.at("/seven.png"))  # the server goes on


def test_tokenize_fetches_http_media_off_the_event_loop(vlm_server, media):
    """``/tokenize`` of messages naming an http(s) image downloads it on a worker thread, as chat
    does: while the media server holds that download (until this test lets it go), the server
    answers another request, and the held download then completes within the 1 s fetch limit.
    A fetch on the event loop would hold the other request until the fetch timed out, and the
    first would be a 400."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=vlm_server.url, headers=headers, timeout=60) as first, \
            httpx.Client(base_url=vlm_server.url, headers=headers, timeout=60) as second, \
            ThreadPoolExecutor(1) as pool:
        held = pool.submit(first.post, "/tokenize", json={"model": VLM, "messages": _user(media.at("/held.png"))})
        assert media.held_requested.wait(30)
        other = second.post("/tokenize", json={"model": VLM, "prompt": "The quick brown fox"})
        media.release_held.set()
        response = held.result()
    assert other.status_code == 200, other.text
    assert response.status_code == 200, response.text
    assert response.json()["count"] > 0
