"""The host KV cache's memory: zero-filled, resident only where written, kept alive by its tensor."""

from __future__ import annotations

import ctypes
import gc
import mmap
import os

import pytest
import torch

from tokenmill.worker.host_memory import lazy_zeros


def _resident_bytes_of_mapping(address: int, length: int) -> int:
    """Resident bytes of ``[address, address + length)`` (mincore): the tensor's own pages,
    whatever other threads of the test process allocate meanwhile. (The Rss line of
    /proc/self/smaps would count a whole VMA, and the kernel may merge the cache's
    mapping with a neighbouring anonymous one that is already resident.) An unmapped
    range has nothing resident."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = address - address % page
    pages = (address + length - start + page - 1) // page
    residency = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * page), residency) != 0:
        return 0  # ENOMEM: (part of) the range is no longer mapped
    return sum(flag & 1 for flag in residency) * page


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


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="Linux only (mincore)")
def test_only_written_pages_are_resident_and_freeing_returns_them():
    cache = lazy_zeros((256, 1 << 18), torch.float32)  # 256 MiB
    address, length = cache.data_ptr(), cache.nbytes
    assert _resident_bytes_of_mapping(address, length) == 0
    cache[:32] = 1.0  # 32 MiB written
    assert 32 << 20 <= _resident_bytes_of_mapping(address, length) < 40 << 20
    del cache
    gc.collect()
    assert _resident_bytes_of_mapping(address, length) < 1 << 20  # unmapped (a small mapping may reuse the range)
