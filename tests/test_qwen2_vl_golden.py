"""Qwen2-VL against transformers (float32, greedy, token for token): images at their own
resolution (one, two of different sizes in one prompt, a batch mixing them with text), M-RoPE
positions through chunked prefill and decoding, the encoder cache, and a video."""

from __future__ import annotations

import pytest
from vlm_models import QWEN2_VL_IMAGE, build_qwen2_vl, hf_qwen2_vl_greedy, random_image

from tokenmill import LLM, SamplingParams
from tokenmill.errors import InvalidRequestError

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen2_vl_path(tmp_path_factory):
    return build_qwen2_vl(tmp_path_factory.mktemp("qwen2_vl"))


@pytest.fixture(scope="module")
def images():
    # 32x40 -> 8x10 patches, 20 tokens; 48x24 -> 12x6 patches, 18 tokens; 16x16 -> 4 tokens
    return [random_image(1, 32, 40), random_image(2, 48, 24), random_image(3, 16, 16)]


@pytest.fixture(scope="module")
def prompts(images):
    im1, im2, im3 = images
    return [
        (f"The quick {QWEN2_VL_IMAGE} brown fox", [im1]),
        (f"The quick {QWEN2_VL_IMAGE} brown fox", [im2]),  # the same text, another size
        (f"Paged attention {QWEN2_VL_IMAGE} keeps {QWEN2_VL_IMAGE} the key value", [im2, im3]),  # two sizes
        ("What is the capital of France?", []),  # text only: plain positions
    ]


@pytest.fixture(scope="module")
def expected(qwen2_vl_path, prompts):
    return hf_qwen2_vl_greedy(qwen2_vl_path, prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def llm(qwen2_vl_path):
    return LLM(str(qwen2_vl_path), dtype="float32", enable_prefix_caching=False,
               limit_mm_per_prompt={"image": 2, "video": 1})


def _mm_prompt(text, images):
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


def _generate(llm, prompts):
    return [out.outputs[0].token_ids for out in llm.generate([_mm_prompt(t, i) for t, i in prompts], GREEDY)]


def test_images_steer_the_reference(expected):
    assert expected[0] != expected[1]


def test_batch_of_images_at_their_own_sizes_matches_transformers(llm, prompts, expected):
    assert _generate(llm, prompts) == expected


def test_chunked_prefill_through_images_matches_transformers(qwen2_vl_path, prompts, expected):
    """A step budget of 7 tokens cuts every image (and its M-RoPE positions) into pieces."""
    llm = LLM(str(qwen2_vl_path), dtype="float32", max_num_batched_tokens=7, max_num_seqs=2)
    assert _generate(llm, prompts) == expected


def test_encoder_cache_reuses_an_image(llm, prompts, expected):
    cache = llm.engine.core.executor.worker.runner.multimodal.cache
    before = (cache.encoded, cache.hits)
    assert _generate(llm, prompts[:1] * 2) == expected[:1] * 2
    assert cache.encoded - before[0] <= 1 and cache.hits > before[1]


def test_too_many_images_are_refused(llm, images):
    text = " ".join([QWEN2_VL_IMAGE] * 3)
    with pytest.raises(InvalidRequestError, match="limit_mm_per_prompt"):
        llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, GREEDY)
    with pytest.raises(InvalidRequestError, match="placeholder"):
        llm.generate({"prompt": QWEN2_VL_IMAGE, "multi_modal_data": {"image": images[:2]}}, GREEDY)
