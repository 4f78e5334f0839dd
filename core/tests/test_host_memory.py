"""The host KV cache's memory: zero-filled, resident only where written, kept alive by its tensor."""

from __future__ import annotations

import gc
import os
import re

import pytest
import torch

from tokenmill.worker.host_memory import lazy_zeros


def _resident_bytes_of_mapping(address: int) -> int:
    """Rss of the mapping that holds ``address`` (from /proc/self/smaps): the tensor's own
    pages, whatever other threads of the test process allocate meanwhile."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
            if span:
                inside = int(span[1], 16) <= address < int(span[2], 16)
            elif inside and line.startswith("Rss:"):
                return int(line.split()[1]) * 1024
    return 0


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


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux only")
def test_only_written_pages_are_resident_and_freeing_returns_them():
    cache = lazy_zeros((256, 1 << 18), torch.float32)  # 256 MiB
    address = cache.data_ptr()
    assert _resident_bytes_of_mapping(address) == 0
    cache[:32] = 1.0  # 32 MiB written
    assert 32 << 20 <= _resident_bytes_of_mapping(address) < 40 << 20
    del cache
    gc.collect()
    assert _resident_bytes_of_mapping(address) < 1 << 20  # unmapped (a small mapping may reuse the range)
