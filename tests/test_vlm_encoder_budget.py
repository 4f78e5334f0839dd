"""LLaVA with a small per-step encoder budget against transformers (float32, greedy): prompts
with several images each, whose encoding the scheduler spreads over steps, give the same tokens
as transformers and as an unlimited budget, and no step encodes more than the budget."""

from __future__ import annotations

import pytest
from vlm_models import IMAGE_TOKENS, build_llava, hf_llava_greedy, random_image

from tokenmill import LLM, SamplingParams

MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llava_path(tmp_path_factory):
    return build_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def prompts():
    im1, im2, im3 = random_image(11), random_image(12, 30, 30), random_image(13, 64, 48)
    return [
        ("Look <image> then <image> and <image> again", [im1, im2, im3]),
        ("<image><image> side by side", [im3, im2]),
        ("A text-only prompt decodes meanwhile", []),
    ]


def _generate(llm, prompts):
    requests = [{"prompt": t, "multi_modal_data": {"image": i}} if i else t for t, i in prompts]
    return [out.outputs[0].token_ids for out in llm.generate(requests, GREEDY)]


def test_a_small_encoder_budget_spreads_images_over_steps_with_the_same_tokens(llava_path, prompts):
    expected = hf_llava_greedy(llava_path, prompts, MAX_TOKENS)
    unlimited = LLM(str(llava_path), dtype="float32", enable_prefix_caching=False)
    assert _generate(unlimited, prompts) == expected
    assert unlimited.engine.core.scheduler.encoder.max_step_tokens > IMAGE_TOKENS  # it did encode several at once
    # every step could take all three prompts whole, but may encode only one image
    llm = LLM(str(llava_path), dtype="float32", enable_prefix_caching=False, max_num_batched_tokens=512,
              max_num_encoder_input_tokens=IMAGE_TOKENS)
    assert _generate(llm, prompts) == expected
    budget = llm.engine.core.scheduler.encoder
    embedder = llm.engine.core.executor.worker.runner.multimodal
    assert budget.num_over_budget_steps == 0
    assert budget.max_step_tokens == IMAGE_TOKENS
    assert budget.num_encoder_steps == 3  # three distinct images, one a step: the cache served the repeats
    assert embedder.max_step_encoded_tokens == IMAGE_TOKENS  # what the encoder ran, not only what was planned
    assert embedder.unscheduled_encodes == 0
    assert embedder.cache.encoded == 3
