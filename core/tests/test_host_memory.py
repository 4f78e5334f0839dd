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


def _thp_mode() -> str | None:
    """The bracketed mode of /sys/kernel/mm/transparent_hugepage/enabled, or None without THP."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def _anon_huge_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping holding ``address``, from /proc/self/smaps."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line: "start-end perms ..."
                start, end = (int(x, 16) for x in fields[0].split("-"))
                inside = start <= address < end
            elif inside and fields[0] == "AnonHugePages:":
                return int(fields[1]) * 1024
    return 0


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="no transparent huge pages on this kernel")
def test_huge_pages_back_the_cache_where_the_os_has_them():
    cache = lazy_zeros((8, 1 << 20), torch.float32, huge_pages=True)  # 32 MiB
    assert cache.data_ptr() % (2 << 20) == 0 and cache.shape == (8, 1 << 20)
    assert _resident_bytes_of_mapping(cache.data_ptr(), cache.nbytes) == 0  # still lazy
    cache[:2] = 1.0  # 8 MiB written
    assert _anon_huge_bytes_at(cache.data_ptr()) >= 4 << 20  # the kernel may fall back to small pages for some
    assert float(cache.sum()) == 2 * (1 << 20)  # the rest reads as zeros
