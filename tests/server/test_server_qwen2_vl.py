"""Qwen2-VL over real HTTP (the openai client): ``video_url`` and ``image_url`` parts give the
Python API's greedy answer; a video where it is not allowed is a 400 naming the problem."""

from __future__ import annotations

import base64
import io

import openai
import pytest
from conftest import API_KEY
from vlm_models import QWEN2_VL_IMAGE, QWEN2_VL_VIDEO, build_qwen2_vl, random_frames, random_image, write_video

from tokenmill import LLM, SamplingParams

VLM = "tiny-qwen2-vl"
GREEDY = dict(model=VLM, temperature=0, max_completion_tokens=6, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def qwen2_vl_path(tmp_path_factory):
    return build_qwen2_vl(tmp_path_factory.mktemp("qwen2-vl-serve"))


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    write_video(folder / "clip.mp4", random_frames(5, 8, 16, 24), fps=4)
    return folder


@pytest.fixture(scope="module")
def qwen2_vl_client(start_server, qwen2_vl_path, media_dir):
    server = start_server([str(qwen2_vl_path), "--served-model-name", VLM, "--kv-cache-memory", "16MiB",
                           "--dtype", "float32", "--allowed-local-media-path", str(media_dir),
                           "--limit-mm-per-prompt", '{"image": 2, "video": 1}'],
                          env={"TOKENMILL_API_KEY": API_KEY})
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _user(*parts) -> list[dict]:
    return [{"role": "user", "content": [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]}]


def test_video_and_image_urls_give_the_python_api_answer(qwen2_vl_client, qwen2_vl_path, media_dir):
    video = (media_dir / "clip.mp4").read_bytes()
    image = random_image(3, 16, 16)
    answers = [
        qwen2_vl_client.chat.completions.create(messages=_user(
            {"type": "video_url", "video_url": {"url": _data_url(video, "video/mp4")}}, "and",
            {"type": "image_url", "image_url": {"url": _data_url(_png(image), "image/png")}}), **GREEDY),
        qwen2_vl_client.chat.completions.create(messages=_user(
            "The", {"type": "video_url", "video_url": {"url": f"file://{media_dir / 'clip.mp4'}"}}), **GREEDY),
    ]
    llm = LLM(str(qwen2_vl_path), dtype="float32")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    template = llm.get_tokenizer().apply_chat_template
    prompts = [
        {"prompt": template([{"role": "user", "content": f"{QWEN2_VL_VIDEO}and{QWEN2_VL_IMAGE}"}], tokenize=False,
                            add_generation_prompt=True),
         "multi_modal_data": {"video": video, "image": [image]}, "add_special_tokens": False},
        {"prompt": template([{"role": "user", "content": f"The{QWEN2_VL_VIDEO}"}], tokenize=False,
                            add_generation_prompt=True),
         "multi_modal_data": {"video": str(media_dir / "clip.mp4")}, "add_special_tokens": False},
    ]
    assert [a.choices[0].message.content for a in answers] == [o.outputs[0].text for o in llm.generate(prompts, params)]
    assert answers[1].usage.prompt_tokens > 12  # the video's tokens are counted


@pytest.mark.parametrize(("part", "problem"), [
    ({"type": "video_url", "video_url": {"url": "file:///etc/hostname"}}, "outside the allowed folder"),
    ({"type": "video_url", "video_url": {"url": _data_url(b"not a video", "video/mp4")}}, "cannot be decoded"),
])
def test_bad_video_input_is_a_400_naming_it(qwen2_vl_client, part, problem):
    with pytest.raises(openai.BadRequestError) as caught:
        qwen2_vl_client.chat.completions.create(messages=_user(part, "hi"), **GREEDY)
    assert problem in str(caught.value)
    ok = qwen2_vl_client.chat.completions.create(messages=_user("hi"), **GREEDY)
    assert ok.choices[0].message.content  # the server goes on
