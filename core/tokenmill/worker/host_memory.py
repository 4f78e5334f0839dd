"""Host (CPU) memory for the KV cache: its own anonymous mapping, zero-filled and
resident only where written.

Pages nobody wrote take no memory, so a generous budget costs nothing up front and
the cache takes resident memory only as blocks are written (``torch.zeros`` would
touch, and keep, every page). The mapping is the cache's alone, not a malloc
block: it goes back to the OS when the cache is freed, and a later cache never
lands on recycled heap memory that calloc would have to clear page by page. That
matters because the CPU platform tells malloc to keep freed memory for reuse
(tokenmill_platform_cpu.allocator).
"""

from __future__ import annotations

import mmap

import numpy as np
import torch


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled tensor whose pages the OS maps on first write; the tensor keeps
    its mapping alive. Where anonymous ``mmap`` is missing (not Linux or macOS) it
    falls back to calloc through numpy, which is lazy too."""
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    private, anonymous = getattr(mmap, "MAP_PRIVATE", None), getattr(mmap, "MAP_ANONYMOUS", None)
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    if private is None or anonymous is None:
        return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)
    mapping = mmap.mmap(-1, nbytes, flags=private | anonymous)
    return torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(shape)
