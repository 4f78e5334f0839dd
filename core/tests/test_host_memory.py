"""The host KV cache's memory: zero-filled, resident only where written, kept alive by its tensor."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from tokenmill.worker.host_memory import lazy_zeros


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_zero_filled_with_the_shape_and_dtype_asked():
    cache = lazy_zeros((3, 16, 2, 8), torch.float32)
    assert cache.shape == (3, 16, 2, 8) and cache.dtype == torch.float32
    assert cache.is_contiguous() and not cache.any()
    cache[1, 2] = 5.0
    assert float(cache.sum()) == 5.0 * 16
    assert lazy_zeros((0, 4), torch.bfloat16).numel() == 0


def test_the_tensor_keeps_its_mapping_alive():
    view = lazy_zeros((1 << 20,), torch.float32)[100:200]
    gc.collect()
    view += 1.0  # writes into the mapping: a freed one would fault
    assert float(view.sum()) == 100.0


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="Linux only")
def test_only_written_pages_are_resident_and_freeing_returns_them():
    before = _resident_bytes()
    cache = lazy_zeros((256, 1 << 18), torch.float32)  # 256 MiB
    assert _resident_bytes() - before < 16 << 20
    cache[:32] = 1.0  # 32 MiB written
    assert 24 << 20 < _resident_bytes() - before < 64 << 20
    del cache
    gc.collect()
    assert _resident_bytes() - before < 16 << 20
