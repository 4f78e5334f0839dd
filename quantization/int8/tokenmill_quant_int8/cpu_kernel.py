"""The W8A8 CPU kernel (``csrc/w8a8_linear.cpp``): compiled on first use, once per source and machine.

Built with ``-march=native`` through :func:`tokenmill.plugin_api.optional_native_extension` (a build
folder per source, flags and CPU under ``$TOKENMILL_KERNEL_CACHE``; concurrent first uses take
turns). ``-ffp-contract=off`` keeps every product and sum rounded on its own, as torch's
elementwise ops round them, so the kernel's output is the torch path's bit for bit (no
``-ffast-math``: it would turn the division into a reciprocal).

:func:`load_w8a8_kernel` returns None (and the torch path runs) where the build fails
(no compiler) or the CPU has neither AVX-512 VNNI nor AVX2 (the module's ``isa()`` is ``"none"``;
otherwise ``"avx512_vnni"`` or ``"avx2"``, the body it was built with).
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

from tokenmill.plugin_api import optional_native_extension

MODULE_NAME = "tokenmill_int8_kernel"
SOURCE = Path(__file__).with_name("csrc") / "w8a8_linear.cpp"
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off"]


@functools.cache
def load_w8a8_kernel() -> ModuleType | None:
    """The compiled module where it runs here (built first if need be), else None; logged once."""
    return optional_native_extension(MODULE_NAME, "int8", [SOURCE], CFLAGS, "int8 W8A8 CPU kernel",
                                     fallback="the torch path", needs="AVX-512 VNNI or AVX2")
