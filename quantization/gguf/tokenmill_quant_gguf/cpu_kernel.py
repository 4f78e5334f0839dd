"""Building and loading the GGUF CPU kernel (``csrc/gguf_matmul.cpp``), once per source and machine.

``torch.utils.cpp_extension.load`` compiles it with ``-march=native`` into a folder of
``$TOKENMILL_KERNEL_CACHE`` (default ``~/.cache/tokenmill/kernels``) named by the Python
environment, torch version, source, flags and CPU, so a changed source or machine gets
a build of its own and a complete one is imported without running the compiler.
Builds take turns under a lock file (released by the OS when its holder dies) and
are written under a temporary name, renamed into place when complete. Where no
compiler is found, :func:`load_cpu_kernel` returns None and the torch reference runs.
"""

from __future__ import annotations

import contextlib
import fcntl
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
MODULE_NAME = "tokenmill_gguf_kernel"
SOURCE = Path(__file__).with_name("csrc") / "gguf_matmul.cpp"
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fno-finite-math-only"]


def build_directory() -> Path:
    root = Path(os.environ.get("TOKENMILL_KERNEL_CACHE", Path.home() / ".cache" / "tokenmill" / "kernels"))
    key = hashlib.sha1()
    for part in (sys.prefix, torch.__version__, SOURCE.read_text(), " ".join(CFLAGS), _cpu_flags()):
        key.update(part.encode() + b"\0")
    return root / f"gguf-{key.hexdigest()[:16]}"


def load_cpu_kernel() -> ModuleType | None:
    """The compiled kernel module, built here first if need be; None where it cannot be built."""
    try:
        return _load_or_build(build_directory())
    except Exception as exc:  # no compiler, no ninja, unsupported flags
        logger.warning("GGUF CPU kernel unavailable (%s); quantized layers use the torch reference", exc)
        return None


def _load_or_build(folder: Path) -> ModuleType:
    library = folder / f"{MODULE_NAME}.so"
    if not library.exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        with _exclusive(folder.parent / "gguf-build.lock"):
            if not library.exists():
                _build(folder)
    spec = importlib.util.spec_from_file_location(MODULE_NAME, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(folder: Path) -> None:
    from torch.utils.cpp_extension import load

    logger.info("building the GGUF CPU kernel into %s (once per machine and source)", folder)
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
    """The CPU's feature flags (what ``-march=native`` compiled for), or its name off Linux."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    return platform.processor()
