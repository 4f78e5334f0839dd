"""Populating fresh pages ahead of use: they become resident, their contents untouched."""

from __future__ import annotations

import os

import pytest
import torch

from tokenmill.worker.host_memory import lazy_zeros
from tokenmill.worker.prefault import populate, populate_in_background


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="Linux only")
def test_populated_pages_become_resident_and_keep_their_contents():
    size = 64 << 20
    buffer = lazy_zeros((size,), torch.uint8)  # as the KV cache is mapped: nothing resident yet
    buffer[size // 2] = 7  # a write that must survive
    before = _resident_bytes()
    if not populate([(buffer.data_ptr(), size)]):
        pytest.skip("the kernel has no MADV_POPULATE_WRITE")
    assert _resident_bytes() - before > size * 3 // 4
    assert int(buffer[size // 2]) == 7 and int(buffer.sum()) == 7


def test_background_thread_finishes_and_bad_ranges_are_refused():
    buffer = lazy_zeros((4 << 20,), torch.uint8)
    populate_in_background([(buffer.data_ptr(), buffer.numel())]).join(timeout=30)
    assert populate([(8, 1 << 20)]) is False  # not mapped: the kernel refuses, nothing breaks
