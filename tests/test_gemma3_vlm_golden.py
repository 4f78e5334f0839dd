"""Gemma 3 with images against transformers (float32, greedy, token for token): two different
images in a batch, two images in one prompt, a text-only prompt, and prefill chunks small enough
that they would end inside an image (the scheduler then cuts before it: an image's tokens attend
to each other both ways, so each is computed in one step)."""

from __future__ import annotations

import pytest
from vlm_models import GEMMA3_IMAGE as IMG
from vlm_models import GEMMA3_IMAGE_TOKENS, build_gemma3, hf_gemma3_greedy, random_image

from tokenmill import LLM, SamplingParams
from tokenmill.errors import InvalidRequestError

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma3_path(tmp_path_factory):
    return build_gemma3(tmp_path_factory.mktemp("gemma3-vlm"))


@pytest.fixture(scope="module")
def prompts():
    im1, im2, im3 = random_image(1), random_image(2, 30, 30), random_image(3, 64, 48)
    return [
        (f"The quick {IMG} brown fox", [im1]),
        (f"The quick {IMG} brown fox", [im2]),  # the same text, another image
        (f"Paged attention {IMG} keeps {IMG} the key value", [im3, im1]),  # two images in one prompt
        ("What is the capital of France?", []),  # text only
    ]


@pytest.fixture(scope="module")
def expected(gemma3_path, prompts):
    return hf_gemma3_greedy(gemma3_path, prompts, MAX_TOKENS)


def _generate(llm, prompts):
    requests = [{"prompt": t, "multi_modal_data": {"image": i}} if i else t for t, i in prompts]
    return [out.outputs[0].token_ids for out in llm.generate(requests, GREEDY)]


def test_images_and_their_bidirectional_mask_steer_the_reference(gemma3_path, prompts, expected):
    """The golden cases below would pass with the images ignored, or attended causally, unless
    both change transformers' output."""
    assert expected[0] != expected[1]
    causal = hf_gemma3_greedy(gemma3_path, prompts[:3], MAX_TOKENS, bidirectional=False)
    assert causal != expected[:3]


def test_batch_mixing_images_matches_transformers(gemma3_path, prompts, expected):
    llm = LLM(str(gemma3_path), dtype="float32")
    assert _generate(llm, prompts) == expected


def test_chunks_that_would_cut_an_image_match_transformers(gemma3_path, prompts, expected):
    """A step budget of 20 tokens ends the first chunk of every image prompt inside its image (the
    image starts a few tokens in and takes 18 with its start and end tokens): the chunk stops
    before the image, which the next step computes whole; a runner given a part of an image raises."""
    llm = LLM(str(gemma3_path), dtype="float32", max_num_batched_tokens=20, max_num_seqs=2)
    assert _generate(llm, prompts) == expected


def test_an_image_larger_than_a_step_is_refused(gemma3_path, prompts):
    llm = LLM(str(gemma3_path), dtype="float32", max_num_batched_tokens=GEMMA3_IMAGE_TOKENS - 1)
    text, images = prompts[0]
    with pytest.raises(InvalidRequestError, match="max_num_batched_tokens"):
        llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, GREEDY)


def test_a_prefix_hit_that_ends_inside_an_image(gemma3_path, prompts, expected):
    """With 16-token blocks a second prompt sharing the text and the image up to the image's end
    reuses the first block, which ends inside the image: the next step takes the image's rest
    whole, its queries attending to the cached part too, and the answer is transformers'."""
    images = prompts[0][1]
    other = f"The quick {IMG} lazy dog"
    llm = LLM(str(gemma3_path), dtype="float32", block_size=16)
    _, items = llm.engine.input_processor.multimodal.process(other, {"image": images})
    assert items[0].offset < 16 < items[0].end
    assert _generate(llm, [prompts[0]]) == expected[:1]
    again = llm.generate({"prompt": other, "multi_modal_data": {"image": images}}, GREEDY)[0]
    assert again.num_cached_tokens == 16
    assert [again.outputs[0].token_ids] == hf_gemma3_greedy(gemma3_path, [(other, images)], MAX_TOKENS)
