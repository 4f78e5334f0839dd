"""Host (CPU) memory for the KV cache: its own anonymous mapping, zero-filled and
resident only where written.

Pages nobody wrote take no memory, so a generous budget costs nothing up front and
the cache takes resident memory only as blocks are written (``torch.zeros`` would
touch, and keep, every page). The mapping is the cache's alone, not a malloc
block: it goes back to the OS when the cache is freed, and a later cache never
lands on recycled heap memory that calloc would have to clear page by page. That
matters because the CPU platform tells malloc to keep freed memory for reuse
(tokenmill_platform_cpu.allocator).

Huge pages: a decode step reads every request's K/V blocks, scattered over the
cache, and with 4 KiB pages each block of a few pages costs TLB misses and stops
the hardware prefetcher at every page boundary. Asking for transparent huge pages
(``madvise(MADV_HUGEPAGE)``, honoured where THP is ``always`` or ``madvise``)
made the paged attention kernel 10-17% faster on a batch of 64 (see
docs/benchmarks.md). Residency then grows 2 MiB at a time instead of 4 KiB.
"""

from __future__ import annotations

import mmap

import numpy as np
import torch

HUGE_PAGE = 2 << 20  # x86-64 and most arm64 kernels; where it is larger, the advice still applies


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, huge_pages: bool = False) -> torch.Tensor:
    """A zero-filled tensor whose pages the OS maps on first write; the tensor keeps
    its mapping alive. ``huge_pages``: ask for transparent huge pages, the tensor
    starting on a huge-page boundary (a no-op where the OS has none). Where anonymous
    ``mmap`` is missing (not Linux or macOS) it falls back to calloc through numpy,
    which is lazy too."""
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    private, anonymous = getattr(mmap, "MAP_PRIVATE", None), getattr(mmap, "MAP_ANONYMOUS", None)
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    if private is None or anonymous is None:
        return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)
    advice = getattr(mmap, "MADV_HUGEPAGE", None) if huge_pages else None
    slack = HUGE_PAGE if advice is not None else 0  # room to start on a boundary (never written: never resident)
    mapping = mmap.mmap(-1, nbytes + slack, flags=private | anonymous)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    start = 0
    if advice is not None:
        mapping.madvise(advice)
        start = -raw.data_ptr() % HUGE_PAGE
    return raw[start : start + nbytes].view(dtype).view(shape)
