"""Qwen2-VL against transformers (float32, greedy, token for token): images at their own
resolution (one, two of different sizes in one prompt, a batch mixing them with text), M-RoPE
positions through chunked prefill and decoding, the encoder cache, and a video."""

from __future__ import annotations

import pytest
from vlm_models import (
    QWEN2_VL_IMAGE,
    QWEN2_VL_VIDEO,
    build_qwen2_vl,
    decoded_frames,
    hf_qwen2_vl_greedy,
    hf_video_tensors,
    random_frames,
    random_image,
    write_video,
)

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
    llm = LLM(str(qwen2_vl_path), dtype="float32", max_num_batched_tokens=7, max_num_seqs=2, block_size=4)
    assert _generate(llm, prompts) == expected
    again = llm.generate([_mm_prompt(*prompts[2])], GREEDY)[0]  # the prefix cache holds its image blocks
    assert again.num_cached_tokens > 20 and again.outputs[0].token_ids == expected[2]


def test_encoder_cache_reuses_an_image(llm, prompts, expected):
    cache = llm.engine.core.executor.worker.runner.multimodal.cache
    before = (cache.encoded, cache.hits)
    assert _generate(llm, prompts[:1] * 2) == expected[:1] * 2
    assert cache.encoded - before[0] <= 1 and cache.hits > before[1]


def test_too_many_items_or_placeholders_are_refused(llm, images):
    text = " ".join([QWEN2_VL_IMAGE] * 3)
    with pytest.raises(InvalidRequestError, match="limit_mm_per_prompt"):
        llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, GREEDY)
    with pytest.raises(InvalidRequestError, match="placeholder"):
        llm.generate({"prompt": QWEN2_VL_IMAGE, "multi_modal_data": {"image": images[:2]}}, GREEDY)
    frames = [random_frames(1, 2, 16, 16)] * 2
    with pytest.raises(InvalidRequestError, match="limit_mm_per_prompt"):
        llm.generate({"prompt": QWEN2_VL_VIDEO * 2, "multi_modal_data": {"video": frames}}, GREEDY)


@pytest.fixture(scope="module")
def video_file(tmp_path_factory):
    """Two seconds at 4 frames a second: sampled at the processor's 2 a second, 4 frames (2 temporal patches)."""
    return write_video(tmp_path_factory.mktemp("video") / "clip.mp4", random_frames(5, 8, 16, 24), fps=4)


def test_video_file_and_frames_match_transformers(qwen2_vl_path, llm, images, video_file):
    """A decoded, sampled mp4 beside an image (M-RoPE's temporal section), and frames given
    directly (three: the last repeated to fill a temporal patch)."""
    frames = random_frames(6, 3, 16, 16)
    cases = [(f"Describe {QWEN2_VL_VIDEO} and {QWEN2_VL_IMAGE} now", [images[2]]), (f"The {QWEN2_VL_VIDEO} fox", [])]
    reference = {0: hf_video_tensors(decoded_frames(video_file, fps=2.0)), 1: hf_video_tensors(frames)}
    expected = hf_qwen2_vl_greedy(qwen2_vl_path, cases, MAX_TOKENS, videos=reference)
    prompts = [{"prompt": cases[0][0], "multi_modal_data": {"image": cases[0][1], "video": str(video_file)}},
               {"prompt": cases[1][0], "multi_modal_data": {"video": list(frames)}}]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected
    without_video = hf_qwen2_vl_greedy(qwen2_vl_path, [(cases[1][0].replace(QWEN2_VL_VIDEO, ""), [])], MAX_TOKENS)
    assert expected[1] != without_video[0]  # the video steers the output


def test_qwen2_5_vl_window_attention_and_video_time_match_transformers(tmp_path, prompts, video_file):
    """Qwen2.5-VL: window attention (windows cut at an image's edges), its video's temporal
    positions spaced by time, and chunked prefill through both, in one batch."""
    path = build_qwen2_vl(tmp_path, version="2.5")
    cases = [*prompts, (f"Describe {QWEN2_VL_VIDEO} now", [])]
    expected = hf_qwen2_vl_greedy(path, cases, MAX_TOKENS, videos={4: hf_video_tensors(decoded_frames(video_file, 2.0))})
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=7, max_num_seqs=3)
    requests = [_mm_prompt(t, i) for t, i in prompts]
    requests.append({"prompt": cases[4][0], "multi_modal_data": {"video": str(video_file)}})
    assert [o.outputs[0].token_ids for o in llm.generate(requests, GREEDY)] == expected
    assert expected[0] != expected[1]
