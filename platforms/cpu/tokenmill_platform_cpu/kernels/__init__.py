"""The CPU platform's C++ kernels, compiled once per machine and Python environment.

``torch.utils.cpp_extension.load`` builds them with the machine's compiler (and
ninja). ``scripts/install`` triggers the build; otherwise the first engine does.
Each Python environment (its prefix and torch version) gets its own build folder,
so two environments on one machine do not rebuild each other's module at every
switch. Where no compiler is available, :func:`load_kernels` returns None and the
platform runs the torch reference ops and the SDPA attention backend instead.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)
_SOURCES = [Path(__file__).with_name(name)
            for name in ("bindings.cpp", "paged_attention.cpp", "cache_write.cpp", "layer_ops.cpp",
                          "small_matmul.cpp", "panel_matmul.cpp", "sampling.cpp", "step_graph.cpp")]


def build_directory() -> Path:
    """``$TOKENMILL_KERNEL_CACHE`` (default ``~/.cache/tokenmill/kernels``), then one folder
    per Python environment and torch version."""
    import torch

    root = Path(os.environ.get("TOKENMILL_KERNEL_CACHE", Path.home() / ".cache" / "tokenmill" / "kernels"))
    environment = hashlib.sha1(f"{sys.prefix}|{torch.__version__}".encode()).hexdigest()[:12]
    return root / f"py{sys.version_info.major}{sys.version_info.minor}-{environment}"


@functools.cache
def load_kernels() -> ModuleType | None:
    try:
        from torch.utils.cpp_extension import load

        folder = build_directory()
        folder.mkdir(parents=True, exist_ok=True)
        return load(
            name="tokenmill_cpu_kernels",
            sources=[str(s) for s in _SOURCES],
            extra_cflags=["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-ffast-math"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, unsupported flags: run without the kernels
        logger.warning("CPU kernels unavailable (%s); using the torch reference ops and SDPA attention", exc)
        return None


def kernels_available() -> bool:
    return load_kernels() is not None
