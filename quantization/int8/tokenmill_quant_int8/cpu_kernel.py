"""The W8A8 CPU kernel (``csrc/w8a8_linear.cpp``): compiled on first use, once per source and machine.

``torch.utils.cpp_extension.load`` builds it with ``-march=native`` into a folder of
``$TOKENMILL_KERNEL_CACHE`` (default ``~/.cache/tokenmill/kernels``) whose name hashes
the Python environment, torch's version, the source, the flags and the CPU's feature
flags: a changed source or another machine gets its own build, and a finished one is
imported without a compiler. Concurrent first uses wait on a lock file (the OS drops
it if its holder dies); a build is written under a temporary name and renamed into
place complete. ``-ffp-contract=off`` keeps every product and sum rounded on its own,
as torch's elementwise ops round them, so the kernel's output is the torch path's
bit for bit (no ``-ffast-math``: it would turn the division into a reciprocal).

:func:`load_w8a8_kernel` returns None (and the torch path runs) where the build fails
(no compiler) or the CPU has no AVX-512 VNNI (the module's ``isa()`` is ``"none"``).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)
MODULE_NAME = "tokenmill_int8_kernel"
SOURCE = Path(__file__).with_name("csrc") / "w8a8_linear.cpp"
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off"]


def build_directory() -> Path:
    root = Path(os.environ.get("TOKENMILL_KERNEL_CACHE", Path.home() / ".cache" / "tokenmill" / "kernels"))
    key = hashlib.sha1()
    for part in (sys.prefix, torch.__version__, SOURCE.read_text(), " ".join(CFLAGS), _cpu_flags()):
        key.update(part.encode() + b"\0")
    return root / f"int8-{key.hexdigest()[:16]}"


@functools.cache
def load_w8a8_kernel() -> ModuleType | None:
    """The compiled module where it runs here (built first if need be), else None; logged once."""
    try:
        module = _load_or_build(build_directory())
    except Exception as exc:  # no compiler, no ninja, flags the compiler refuses
        logger.warning("int8 W8A8 CPU kernel unavailable (%s); the torch path runs", exc)
        return None
    if module.isa() == "none":
        logger.info("int8 W8A8 CPU kernel not used: this CPU has no AVX-512 VNNI; the torch path runs")
        return None
    return module


def _load_or_build(folder: Path) -> ModuleType:
    library = folder / f"{MODULE_NAME}.so"
    if not library.exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        with _exclusive(folder.parent / "int8-build.lock"):
            if not library.exists():  # another process may have built it while we waited
                _build(folder)
    spec = importlib.util.spec_from_file_location(MODULE_NAME, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(folder: Path) -> None:
    from torch.utils.cpp_extension import load

    logger.info("building the int8 W8A8 CPU kernel into %s (once per machine and source)", folder)
    staging = Path(tempfile.mkdtemp(prefix=folder.name + ".building-", dir=folder.parent))
    try:
        load(name=MODULE_NAME, sources=[str(SOURCE)], extra_cflags=CFLAGS, build_directory=str(staging),
             verbose=False)
        staging.chmod(0o755)
        staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _cpu_flags() -> str:
    """What ``-march=native`` compiles for: the CPU's feature flags (its name off Linux)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    return platform.processor()
