"""glibc malloc told to keep freed memory for the next step's activations.

torch's CPU allocator is plain malloc. glibc serves blocks above its mmap
threshold (at most 32 MiB) with fresh mappings and unmaps them on free, and
trims other freed memory at the top of the heap back to the OS: either way the
next step gets fresh pages and pays a page fault for each 4 KiB of them (5-15 µs
on the VMs we run on). A prefill step of 2,048 tokens through the 100M
benchmark model made ~115,000 faults (its gate/up activations are 33.5 MiB);
with mmap off and a high trim threshold, ~40, and the step ran ~9% faster (a
whole second run in one process 3-5%, a cold benchmark run ~1%). Models wider
than that one gain more.

Freed blocks that do not fit later requests stay in the heap, so peak RSS
grows a little (+100 MB on the 100M benchmark run, ~+10 MB on tiny);
``TOKENMILL_MALLOC_RETAIN`` bounds how much free memory the heap keeps at its
top (default 1 GiB; ``0`` leaves malloc as it is). The KV cache is not
affected: it has its own mapping (tokenmill.worker.host_memory).
"""

from __future__ import annotations

import ctypes
import logging
import os

from tokenmill.plugin_api import parse_size

logger = logging.getLogger(__name__)

DEFAULT_RETAIN = "1GiB"
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


def retain_bytes() -> int:
    return parse_size(os.environ.get("TOKENMILL_MALLOC_RETAIN", DEFAULT_RETAIN))


def keep_freed_memory(retain: int) -> bool:
    """Stop glibc from unmapping or trimming freed memory below ``retain`` bytes.
    Returns whether it took effect (False off glibc, or for ``retain`` 0)."""
    if retain <= 0:
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (only glibc has it; musl's mallopt is a stub)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    retain = min(retain, 2**31 - 1)  # mallopt takes an int
    done = mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, retain) == 1
    if not done:
        logger.debug("mallopt refused; malloc left as it is")
    return done
