"""Multimodal input through the Python API: chat content parts with images, and every bad input
refused by name (InvalidRequestError) before anything is queued, the engine going on."""

from __future__ import annotations

import base64
import io

import pytest
from vlm_models import build_llava, random_image

from tokenmill import LLM, InvalidRequestError, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(str(build_llava(tmp_path_factory.mktemp("llava-inputs"))), dtype="float32", max_model_len=40,
               limit_mm_per_prompt={"image": 2})


def _data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_chat_image_parts_are_the_rendered_prompt_with_its_images(llm):
    image = random_image(5)
    chat = llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(image)}},
                                                  {"type": "text", "text": "The fox"}]}], GREEDY)
    text = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "<image>The fox"}],
                                                   tokenize=False, add_generation_prompt=True)
    direct = llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, GREEDY)
    assert chat[0].outputs[0].token_ids == direct[0].outputs[0].token_ids
    assert chat[0].prompt_token_ids == direct[0].prompt_token_ids


@pytest.mark.parametrize(("prompt", "problem"), [
    ({"prompt": "<image><image><image> x", "multi_modal_data": {"image": [random_image(i) for i in range(3)]}},
     "limit_mm_per_prompt"),
    ({"prompt": "no placeholder here", "multi_modal_data": {"image": random_image(1)}}, "placeholder"),
    ({"prompt": "<image> and <image>", "multi_modal_data": {"image": [random_image(1)]}}, "placeholder"),
    ({"prompt": "<image> x", "multi_modal_data": {"image": b"\x89PNG not decoded"}}, "PIL.Image"),
    ({"prompt": "<image> x", "multi_modal_data": {"audio": [1.0]}}, "not ['audio']"),
    ({"prompt_token_ids": [5, 6], "multi_modal_data": {"image": random_image(1)}}, "text"),
    ({"prompt": "<image><image> The quick brown fox jumps over the lazy dog",
      "multi_modal_data": {"image": [random_image(1), random_image(2)]}}, "max_model_len"),
    ("a literal <image> token with no image", "placeholder"),
])
def test_bad_multimodal_input_is_refused_by_name(llm, prompt, problem):
    with pytest.raises(InvalidRequestError, match=None) as caught:
        llm.generate(prompt, GREEDY)
    assert problem in str(caught.value)
    assert llm.generate({"prompt": "<image> x", "multi_modal_data": {"image": random_image(1)}}, GREEDY)[0].outputs


def test_text_model_refuses_images(llama_path):
    llm = LLM(str(llama_path), dtype="float32")
    with pytest.raises(InvalidRequestError, match="takes no images"):
        llm.generate({"prompt": "<image> x", "multi_modal_data": {"image": random_image(1)}}, GREEDY)
    with pytest.raises(InvalidRequestError, match="takes no images"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(random_image(1))}}]}])
