"""The CPU platform's C++ kernels, compiled on first use.

``torch.utils.cpp_extension.load`` builds them with the machine's compiler
(and ninja) into torch's extension cache, so the build happens once per
machine; where no compiler is available, :func:`load_kernels` returns None and
the platform falls back to the SDPA reference backend.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)
_SOURCES = [Path(__file__).with_name(name) for name in ("bindings.cpp", "paged_attention.cpp", "layer_ops.cpp", "sampling.cpp")]


@functools.cache
def load_kernels() -> ModuleType | None:
    try:
        from torch.utils.cpp_extension import load

        return load(
            name="tokenmill_cpu_kernels",
            sources=[str(s) for s in _SOURCES],
            extra_cflags=["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-ffast-math"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, unsupported flags: run without the kernel
        logger.warning("CPU attention kernels unavailable (%s); using the SDPA backend", exc)
        return None


def kernels_available() -> bool:
    return load_kernels() is not None
