"""Faulting in fresh KV-cache pages ahead of use, off the engine's thread.

The CPU KV cache is mapped lazily (host_memory): pages nobody wrote take no
memory, and the first write to each one is a page fault (5-15 µs on the VMs we
run on). A background thread asks the kernel to populate the first part of the
cache with ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+), which maps the pages without
changing their contents, so it can run while the engine already writes K/V
there. Where the call is unavailable nothing happens: the pages fault in on
first use as before.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading
from collections.abc import Sequence

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23


def populate(ranges: Sequence[tuple[int, int]]) -> bool:
    """Populate each ``(address, length)`` range, rounded inward to whole pages.
    Returns False (having done nothing more) once the kernel refuses."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    for address, length in ranges:
        start = -(-address // page) * page
        end = (address + length) // page * page
        if end > start and madvise(start, end - start, MADV_POPULATE_WRITE) != 0:
            logger.debug("MADV_POPULATE_WRITE unavailable (errno %d)", ctypes.get_errno())
            return False
    return True


def populate_in_background(ranges: Sequence[tuple[int, int]], owners: Sequence[object] = ()) -> threading.Thread:
    """``populate`` on a daemon thread (ctypes releases the GIL during the call).
    ``owners`` (the tensors the ranges belong to) are held until it is done, so the
    memory cannot be freed and reused under it."""
    def run(ranges: list[tuple[int, int]], owners: list[object]) -> None:
        populate(ranges)

    thread = threading.Thread(target=run, args=(list(ranges), list(owners)), name="tokenmill-kv-prefault",
                              daemon=True)
    thread.start()
    return thread
