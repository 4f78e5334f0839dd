"""LLaVA against transformers (float32, greedy, token for token): images in a batch, several
images in one prompt, text-only prompts, chunked prefill that cuts through an image, the
prefix cache keyed by image content, and the encoder cache."""

from __future__ import annotations

import pytest
from vlm_models import IMAGE_TOKENS, build_llava, hf_llava_greedy, random_image

from tokenmill import LLM, SamplingParams

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llava_path(tmp_path_factory):
    return build_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def images():
    return [random_image(1), random_image(2, 30, 30), random_image(3, 64, 48)]


@pytest.fixture(scope="module")
def prompts(images):
    im1, im2, im3 = images
    return [
        ("The quick <image> brown fox", [im1]),
        ("The quick <image> brown fox", [im2]),  # the same text, another image
        ("Paged attention <image> keeps <image> the key value", [im3, im1]),  # two images in one prompt
        ("What is the capital of France?", []),  # text only
        ("<image><image> Prefix caching", [im2, im3]),  # adjacent placeholders: one run of image tokens
    ]


@pytest.fixture(scope="module")
def expected(llava_path, prompts):
    return hf_llava_greedy(llava_path, prompts, MAX_TOKENS)


def _mm_prompt(text, images):
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


def _generate(llm, prompts):
    return [out.outputs[0].token_ids for out in llm.generate([_mm_prompt(t, i) for t, i in prompts], GREEDY)]


def _encoder_cache(llm):
    return llm.engine.core.executor.worker.runner.multimodal.cache


def test_images_steer_the_reference(expected):
    """The golden cases below would pass with the images ignored unless the images change the output."""
    assert expected[0] != expected[1]


def test_batch_mixing_images_matches_transformers(llava_path, prompts, expected):
    llm = LLM(str(llava_path), dtype="float32")
    assert _generate(llm, prompts) == expected


@pytest.mark.parametrize("budget", [5, 11])
def test_chunked_prefill_through_images_matches_transformers(llava_path, prompts, expected, budget):
    """A step budget below an image's 16 tokens: every image is computed over several steps,
    each taking its own rows of the encoder output."""
    llm = LLM(str(llava_path), dtype="float32", max_num_batched_tokens=budget, max_num_seqs=2)
    assert _generate(llm, prompts) == expected


def test_prefix_cache_keys_on_the_image(llava_path, images, expected):
    """The same prompt and image reuse the KV of the image's blocks; another image behind the
    same placeholder tokens does not, and still gives its own answer."""
    llm = LLM(str(llava_path), dtype="float32", block_size=4)
    text = "The quick <image> brown fox"
    first = llm.generate([_mm_prompt(text, [images[0]])], GREEDY)[0]
    again = llm.generate([_mm_prompt(text, [images[0]])], GREEDY)[0]
    other = llm.generate([_mm_prompt(text, [images[1]])], GREEDY)[0]
    image_offset = len(llm.get_tokenizer().encode("The quick "))
    assert again.num_cached_tokens >= image_offset + IMAGE_TOKENS - 4
    assert other.num_cached_tokens <= image_offset
    assert [first.outputs[0].token_ids, again.outputs[0].token_ids, other.outputs[0].token_ids] == [
        expected[0], expected[0], expected[1]]


def test_encoder_cache_reuses_an_image_across_requests(llava_path, images, expected):
    llm = LLM(str(llava_path), dtype="float32", enable_prefix_caching=False)
    cache = _encoder_cache(llm)
    assert _generate(llm, [("The quick <image> brown fox", [images[0]])]) == [expected[0]]
    assert cache.encoded == 1
    assert _generate(llm, [("The quick <image> brown fox", [images[0]])]) == [expected[0]]
    assert (cache.encoded, cache.hits) == (1, 1)  # the second request's image came from the cache
    assert _generate(llm, [("The quick <image> brown fox", [images[1]])]) == [expected[1]]
    assert cache.encoded == 2
    stats = llm.engine.scheduler_stats  # the same counts reach the engine's metrics
    assert (stats.encoder_cache_queries, stats.encoder_cache_hits) == (3, 1)


def test_encoder_cache_too_small_re_encodes(llava_path, prompts, expected):
    """A budget below one image's rows keeps nothing: each chunk of an image encodes it again."""
    llm = LLM(str(llava_path), dtype="float32", mm_encoder_cache_size=IMAGE_TOKENS - 1, max_num_batched_tokens=8,
              max_num_seqs=1)
    assert _generate(llm, prompts[:1]) == expected[:1]
    cache = _encoder_cache(llm)
    assert len(cache) == 0
    assert cache.encoded >= 2  # the image's 16 tokens span at least two 8-token steps


def test_preemption_recomputes_images_exactly(llava_path, prompts, expected):
    """Too few KV blocks for the batch: requests are preempted and recomputed, images included."""
    llm = LLM(str(llava_path), dtype="float32", num_kv_blocks=8, block_size=8, max_model_len=64)
    assert _generate(llm, prompts) == expected
    assert llm.engine.scheduler_stats.num_preemptions > 0


def test_tensor_parallel_ranks_encode_their_own_images(llava_path, prompts, expected):
    """Two ranks in two processes: the items travel in the step diffs; each rank runs the tower
    (replicated) and its share of the language model."""
    llm = LLM(str(llava_path), dtype="float32", max_model_len=128, tensor_parallel_size=2)
    try:
        assert _generate(llm, prompts) == expected
    finally:
        llm.engine.shutdown()


def test_processor_kwargs_reach_the_processor_and_the_hash(llava_path, prompts):
    """``mm_processor_kwargs`` change the pixels as transformers' processor changes them, and an
    image processed otherwise is another encoder-cache entry."""
    text, images = prompts[0]
    unnormalised = hf_llava_greedy(llava_path, [(text, images)], MAX_TOKENS, do_normalize=False)
    llm = LLM(str(llava_path), dtype="float32", enable_prefix_caching=False)
    plain = llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, GREEDY)
    other = llm.generate({"prompt": text, "multi_modal_data": {"image": images},
                          "mm_processor_kwargs": {"do_normalize": False}}, GREEDY)
    assert [other[0].outputs[0].token_ids] == unnormalised
    assert plain[0].outputs[0].token_ids != other[0].outputs[0].token_ids
    assert _encoder_cache(llm).encoded == 2
