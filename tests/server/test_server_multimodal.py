"""Chat with images over real HTTP (the openai client): data: URLs and file:// paths give the
Python API's greedy answer (LLaVA, and Gemma 3 once); bad image input is a 400 naming the problem,
and the server goes on; the encoder cache and budget counters reach /metrics."""

from __future__ import annotations

import base64
import io

import httpx
import openai
import pytest
from conftest import API_KEY
from prometheus_client.parser import text_string_to_metric_families
from vlm_models import GEMMA3_IMAGE, GEMMA3_IMAGE_TOKENS, build_gemma3, build_llava, random_image

from tokenmill import LLM, SamplingParams

VLM = "tiny-llava"
MAX_MODEL_LEN = 56  # two 16-token images fit beside the template; three do not
GREEDY = dict(model=VLM, temperature=0, max_completion_tokens=6, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def llava_path(tmp_path_factory):
    return build_llava(tmp_path_factory.mktemp("llava-serve"))


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    random_image(7).save(folder / "seven.png")
    return folder


@pytest.fixture(scope="module")
def vlm_server(start_server, llava_path, media_dir):
    """An encoder budget of one image a step (16 rows): a prompt's second image waits a step."""
    return start_server([str(llava_path), "--served-model-name", VLM, "--max-model-len", str(MAX_MODEL_LEN),
                         "--kv-cache-memory", "16MiB", "--dtype", "float32", "--allowed-local-media-path",
                         str(media_dir), "--limit-mm-per-prompt", '{"image": 3}',
                         "--max-num-encoder-input-tokens", "16"], env={"TOKENMILL_API_KEY": API_KEY})


@pytest.fixture(scope="module")
def vlm_client(vlm_server):
    return openai.OpenAI(base_url=f"{vlm_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _data_url(image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def _image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _user(*parts) -> list[dict]:
    return [{"role": "user", "content": [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]}]


def _python_api(llava_path, text_with_placeholders: str, images) -> str:
    """The same chat through ``LLM``: the template rendered with ``<image>`` where each part was."""
    llm = LLM(str(llava_path), dtype="float32", max_model_len=MAX_MODEL_LEN)
    prompt = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": text_with_placeholders}],
                                                     tokenize=False, add_generation_prompt=True)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}, "add_special_tokens": False}, params)
    return out[0].outputs[0].text


def test_image_urls_give_the_python_api_answer(vlm_client, llava_path, media_dir):
    first, second = random_image(1), random_image(2, 30, 30)
    seven = random_image(7)  # what the file holds (PNG is lossless)
    answers = [
        vlm_client.chat.completions.create(messages=_user(_image_part(_data_url(first)), "The quick brown fox"),
                                           **GREEDY),
        vlm_client.chat.completions.create(messages=_user("Paged", _image_part(_data_url(second)), "attention",
                                                          _image_part(f"file://{media_dir / 'seven.png'}")),
                                           **GREEDY),
    ]
    texts = [a.choices[0].message.content for a in answers]
    assert texts == [_python_api(llava_path, "<image>The quick brown fox", [first]),
                     _python_api(llava_path, "Paged<image>attention<image>", [second, seven])]
    assert answers[1].usage.prompt_tokens > 32  # both images' tokens are counted


@pytest.mark.parametrize(("messages", "problem"), [
    (_user(_image_part("data:image/png;base64," + base64.b64encode(b"not an image at all").decode()), "hi"),
     "not in an image format"),
    (_user(_image_part("data:image/png;base64,%%%"), "hi"), "invalid base64"),
    (_user(*[_image_part(_data_url(random_image(i))) for i in range(4)]), "limit_mm_per_prompt"),
    (_user("<image> and", _image_part(_data_url(random_image(1)))), "placeholder"),
    (_user(*[_image_part(_data_url(random_image(i))) for i in range(3)]), "max_model_len"),
    (_user(_image_part("file:///etc/hostname"), "hi"), "outside the allowed folder"),
    (_user(_image_part("ftp://example.com/cat.png"), "hi"), "not supported"),
])
def test_bad_image_input_is_a_400_naming_it(vlm_client, messages, problem):
    with pytest.raises(openai.BadRequestError) as caught:
        vlm_client.chat.completions.create(messages=messages, **GREEDY)
    assert caught.value.status_code == 400
    assert problem in str(caught.value)
    ok = vlm_client.chat.completions.create(messages=_user(_image_part(_data_url(random_image(1))), "hi"), **GREEDY)
    assert ok.choices[0].message.content  # the server goes on


def test_text_model_given_an_image_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(messages=_user(_image_part(_data_url(random_image(1))), "hi"),
                                       model="tiny-llama", max_completion_tokens=4)
    assert "takes no images" in str(caught.value)


def test_responses_api_input_image_is_the_chat_answer(vlm_client):
    image = _data_url(random_image(3))
    chat = vlm_client.chat.completions.create(messages=_user(_image_part(image), "The quick brown fox"), **GREEDY)
    response = vlm_client.responses.create(
        model=VLM, temperature=0, max_output_tokens=6, extra_body={"ignore_eos": True},
        input=[{"role": "user", "content": [{"type": "input_image", "image_url": image},
                                            {"type": "input_text", "text": "The quick brown fox"}]}])
    assert response.output_text == chat.choices[0].message.content


def _encoder_counters(server) -> dict[str, float]:
    """The encoder counters of ``/metrics`` (Prometheus text, no key needed)."""
    names = ("encoder_cache_queries", "encoder_cache_hits", "encoder_input_tokens", "encoder_budget_deferrals")
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    samples = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    return {name: samples[f"tokenmill:{name}_total"] for name in names}


def test_encoder_counters_reach_metrics(vlm_server, vlm_client):
    """Two new images in one prompt encode 32 rows over two steps (the budget holds one: the
    second waits, a deferral); a later prompt with the first image behind other text finds it in
    the encoder cache."""
    first, second = _data_url(random_image(21)), _data_url(random_image(22))
    before = _encoder_counters(vlm_server)
    vlm_client.chat.completions.create(messages=_user("Paged", _image_part(first), "attention",
                                                      _image_part(second)), **GREEDY)
    vlm_client.chat.completions.create(messages=_user("Other words first", _image_part(first)), **GREEDY)
    after = _encoder_counters(vlm_server)
    grown = {name: after[name] - before[name] for name in after}
    assert grown["encoder_input_tokens"] == 32
    assert grown["encoder_budget_deferrals"] >= 1
    assert grown["encoder_cache_queries"] >= 3
    assert grown["encoder_cache_hits"] >= 1


@pytest.fixture(scope="module")
def gemma3_path(tmp_path_factory):
    return build_gemma3(tmp_path_factory.mktemp("gemma3-serve"))


def test_gemma3_image_url_gives_the_python_api_answer(start_server, gemma3_path):
    server = start_server([str(gemma3_path), "--served-model-name", "tiny-gemma3", "--kv-cache-memory", "16MiB",
                           "--dtype", "float32"], env={"TOKENMILL_API_KEY": API_KEY})
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    image = random_image(4)
    answer = client.chat.completions.create(messages=_user(_image_part(_data_url(image)), "The quick brown fox"),
                                            **{**GREEDY, "model": "tiny-gemma3"})
    llm = LLM(str(gemma3_path), dtype="float32")
    prompt = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": f"{GEMMA3_IMAGE}The quick brown fox"}], tokenize=False, add_generation_prompt=True)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": [image]}, "add_special_tokens": False}, params)
    assert answer.choices[0].message.content == out[0].outputs[0].text
    assert answer.usage.prompt_tokens > GEMMA3_IMAGE_TOKENS  # the image's tokens are counted
