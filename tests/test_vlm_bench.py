"""The random-mm bench dataset: images repeat as asked, and the tokenmill backend runs them
on a multimodal model, counting the image tokens as input."""

from __future__ import annotations

import numpy as np
import pytest
from vlm_models import IMAGE_TOKENS, build_llava

from tokenmill_cli.bench.datasets import DatasetContext, DatasetOptions, Vocabulary, load_dataset
from tokenmill_cli.bench.tokenmill_backend import TokenmillBackend


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    return TokenmillBackend(str(build_llava(tmp_path_factory.mktemp("llava-bench"))),
                            {"dtype": "float32", "enable_prefix_caching": False})


def _requests(backend, **options):
    ctx = DatasetContext(backend.tokenizer, Vocabulary.from_tokenizer(backend.tokenizer, backend.vocab_size))
    opts = DatasetOptions(name="random-mm", num_prompts=6, random_input_len=8, random_output_len=3, **options)
    return load_dataset(opts, ctx)


def test_random_mm_draws_from_the_distinct_pictures(backend):
    requests = _requests(backend, random_mm_num_images=2, random_mm_distinct_images=3, random_mm_image_size=40)
    images = [image for r in requests for image in r.images]
    assert len(images) == 12 and all(image.size == (40, 40) for image in images)
    assert len({np.asarray(image).tobytes() for image in images}) == 3
    assert all(r.prompt for r in requests)


def test_tokenmill_backend_runs_random_mm(backend):
    requests = _requests(backend, random_mm_distinct_images=2)
    cache = backend.llm.engine.core.executor.worker.runner.multimodal.cache
    encoded_before = cache.encoded
    records = backend.run(requests, temperature=0.0)
    assert [r.error for r in records] == [None] * 6
    assert all(r.prompt_len >= IMAGE_TOKENS for r in records)  # the image's tokens are input tokens
    assert cache.encoded - encoded_before <= 2  # two distinct pictures: the rest came from the cache
