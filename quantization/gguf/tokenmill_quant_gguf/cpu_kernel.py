"""Building and loading the GGUF CPU kernel (``csrc/gguf_matmul.cpp``, ``csrc/gguf_q8_matmul.cpp``), once per
source and machine.

Compiled with ``-march=native`` on first use through :func:`tokenmill.plugin_api.optional_native_extension`
(a build folder per source, flags and CPU under ``$TOKENMILL_KERNEL_CACHE``; concurrent first
uses take turns). Where no compiler is found, :func:`load_cpu_kernel` returns None and the torch
reference runs.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from tokenmill.plugin_api import optional_native_extension

MODULE_NAME = "tokenmill_gguf_kernel"
SOURCES = [Path(__file__).with_name("csrc") / name for name in ("gguf_matmul.cpp", "gguf_q8_matmul.cpp")]
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fno-finite-math-only"]


def load_cpu_kernel() -> ModuleType | None:
    """The compiled kernel module, built here first if need be; None where it cannot be built."""
    return optional_native_extension(MODULE_NAME, "gguf", SOURCES, CFLAGS, "GGUF CPU kernel",
                                     fallback="the torch reference of quantized layers")
