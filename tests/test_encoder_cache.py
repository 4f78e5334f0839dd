"""The encoder cache's budget and eviction, and the content hash that keys it."""

from __future__ import annotations

import pytest
import torch

from tokenmill.multimodal import EncoderCache, content_hash


def _output(rows: int) -> torch.Tensor:
    return torch.zeros(rows, 4)


def test_least_recently_used_goes_first_within_the_budget():
    cache = EncoderCache(10)
    cache.put("a", _output(4))
    cache.put("b", _output(4))
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("c", _output(4))  # 12 > 10: b, the least recent, goes
    assert (cache.get("b"), cache.used, len(cache)) == (None, 8, 2)
    assert cache.get("a") is not None and cache.get("c") is not None
    assert (cache.queries, cache.hits) == (4, 3)


def test_an_output_larger_than_the_budget_is_not_kept_and_evicts_nothing():
    cache = EncoderCache(5)
    cache.put("small", _output(3))
    cache.put("big", _output(6))
    assert cache.get("big") is None and cache.get("small") is not None


def test_a_negative_budget_is_refused():
    with pytest.raises(ValueError, match="at least 0"):
        EncoderCache(-1)


def test_content_hash_follows_pixels_and_options():
    pixels = torch.arange(12, dtype=torch.float32).reshape(1, 3, 2, 2)
    same = content_hash("image", {"pixel_values": pixels.clone()}, {})
    assert content_hash("image", {"pixel_values": pixels}, {}) == same
    assert content_hash("image", {"pixel_values": pixels + 1}, {}) != same
    assert content_hash("image", {"pixel_values": pixels}, {"do_resize": False}) != same
    assert content_hash("video", {"pixel_values": pixels}, {}) != same
