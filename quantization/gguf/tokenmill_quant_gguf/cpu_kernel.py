"""Building and loading the GGUF CPU kernel (``csrc/gguf_matmul.cpp``, ``csrc/gguf_q8_matmul.cpp``), once per
source and machine.

Compiled with ``-march=native`` on first use through :func:`tokenmill.plugin_api.load_native_extension`
(a build folder per source, flags and CPU under ``$TOKENMILL_KERNEL_CACHE``; concurrent first
uses take turns). Where no compiler is found, :func:`load_cpu_kernel` returns None and the torch
reference runs.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType

from tokenmill.plugin_api import load_native_extension

logger = logging.getLogger(__name__)
MODULE_NAME = "tokenmill_gguf_kernel"
SOURCES = [Path(__file__).with_name("csrc") / name for name in ("gguf_matmul.cpp", "gguf_q8_matmul.cpp")]
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fno-finite-math-only"]


def load_cpu_kernel() -> ModuleType | None:
    """The compiled kernel module, built here first if need be; None where it cannot be built."""
    try:
        return load_native_extension(MODULE_NAME, "gguf", SOURCES, CFLAGS, "GGUF CPU kernel")
    except Exception as exc:  # no compiler, no ninja, unsupported flags
        logger.warning("GGUF CPU kernel unavailable (%s); quantized layers use the torch reference", exc)
        return None
