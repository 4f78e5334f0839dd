"""Compiling a plugin's C++ kernel on first use, once per source and machine.

Quantization plugins carry small C++ kernels (GGUF's in-register dequantising matmul, int8's
fused W8A8 linear) that are compiled where they run, with ``-march=native``, rather than
shipped as wheels for every CPU. :func:`load_native_extension` builds one with
``torch.utils.cpp_extension.load`` into a folder of ``$TOKENMILL_KERNEL_CACHE`` (default
``~/.cache/tokenmill/kernels``) whose name hashes the Python environment, torch's version, the
sources (and the headers beside them), the flags and the CPU's feature flags: a changed source
or header, or another machine, gets its own build, and a finished one is imported without a compiler. Concurrent first uses take turns
under a lock file (the OS drops it if its holder dies); a build is written under a temporary
name and renamed into place complete, so a reader never sees half of one.

A kernel that a model's decode step calls should be registered as a torch op (``TORCH_LIBRARY``)
with an out overload, ``ns::name(...) -> Tensor`` and ``ns::name.out(..., *, Tensor(a!) out) ->
Tensor(a!)``, and called as ``torch.ops.ns.name``: the CPU platform's step graphs then record and
replay it (docs/plugins.md, "Quantization methods"); without the out overload such steps run eagerly.

Every build gets :func:`native_include_dir` on its include path: ``<tokenmill/parallel.h>``
gives a kernel ``tokenmill::parallel_for`` (at::parallel_for's signature), which runs its loop on the
thread pool a platform published with :func:`publish_parallel_backend` (the CPU platform's: the one
its own kernels of the same step run on) and on at::parallel_for where none was.
:func:`import_built_extension` attaches each extension it imports to the published pool (or to
the one published later); the contract is ``csrc/include/tokenmill/parallel_abi.h``'s.

(The CPU platform's own kernels have a richer builder: progress reports, seeding from an older
build, a packaged ninja. This one is the small common case.)
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)
PARALLEL_BACKEND_CAPSULE = b"tokenmill.parallel_backend"  # TOKENMILL_PARALLEL_BACKEND_CAPSULE
_ATTACH_SYMBOL = "tokenmill_parallel_attach"  # what <tokenmill/parallel.h> exports


def load_native_extension(module_name: str, cache_prefix: str, sources: Sequence[Path],
                          cflags: Sequence[str], description: str) -> ModuleType:
    """The compiled module `module_name` of `sources`, built first if this machine has no build
    of them yet. Raises whatever the build raises (no compiler, no ninja, refused flags): the
    caller decides what runs instead (:func:`optional_native_extension` logs and returns None). `cache_prefix` names the build folders (``gguf-<hash>``);
    `description` is what the build's log line calls it."""
    folder = build_directory(cache_prefix, sources, cflags)
    library = folder / f"{module_name}.so"
    if not library.exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        with _exclusive(folder.parent / f"{cache_prefix}-build.lock"):
            if not library.exists():  # another process may have built it while we waited
                _build(module_name, sources, cflags, folder, description)
    return import_built_extension(module_name, library)


def native_include_dir() -> Path:
    """The headers tokenmill gives C++ kernels (``tokenmill/parallel.h``), on every build's include path."""
    return Path(__file__).with_name("csrc") / "include"


def native_headers() -> list[Path]:
    """The headers under :func:`native_include_dir`: part of what names a build, as its sources are."""
    return sorted(native_include_dir().rglob("*.h"))


def optional_native_extension(module_name: str, cache_prefix: str, sources: Sequence[Path], cflags: Sequence[str],
                              description: str, fallback: str, needs: str = "") -> ModuleType | None:
    """:func:`load_native_extension`'s module where it runs here, else None, with a log line saying
    which and why: the build failed (a warning: no compiler, no ninja, refused flags) or, for a
    module with an ``isa()`` function, it returned ``"none"`` (the CPU lacks ``needs``). `fallback`
    says what runs instead (``"the torch path"``). Callers cache the answer (functools.cache)."""
    try:
        module = load_native_extension(module_name, cache_prefix, sources, cflags, description)
    except Exception as exc:  # whatever the build raises: the fallback runs
        logger.warning("%s unavailable (%s); %s runs", description, exc, fallback)
        return None
    isa = module.isa() if hasattr(module, "isa") else None
    if isa == "none":
        logger.info("%s not used: this CPU has no %s; %s runs", description, needs or "instruction set it needs",
                    fallback)
        return None
    logger.info("%s: %s", description, isa or "built")
    return module


def build_directory(cache_prefix: str, sources: Sequence[Path], cflags: Sequence[str]) -> Path:
    import torch

    root = Path(os.environ.get("TOKENMILL_KERNEL_CACHE", Path.home() / ".cache" / "tokenmill" / "kernels"))
    key = hashlib.sha1()
    texts = [s.read_text() for s in (*sources, *_headers_beside(sources), *native_headers())]
    for part in (sys.prefix, torch.__version__, *texts, " ".join(cflags), _cpu_flags()):
        key.update(part.encode() + b"\0")
    return root / f"{cache_prefix}-{key.hexdigest()[:16]}"


def _headers_beside(sources: Sequence[Path]) -> list[Path]:
    """The headers (``*.h``) in the sources' folders, which the sources include by a relative
    name: part of what a build is made of, so an edited header gets a build of its own."""
    folders = sorted({source.parent for source in sources})
    return [header for folder in folders for header in sorted(folder.glob("*.h"))]


def _build(module_name: str, sources: Sequence[Path], cflags: Sequence[str], folder: Path, description: str) -> None:
    from torch.utils.cpp_extension import load

    logger.info("building the %s into %s (once per machine and source)", description, folder)
    staging = Path(tempfile.mkdtemp(prefix=folder.name + ".building-", dir=folder.parent))
    try:
        load(name=module_name, sources=[str(s) for s in sources], extra_cflags=list(cflags),
             extra_include_paths=[str(native_include_dir())], build_directory=str(staging), verbose=False)
        staging.chmod(0o755)
        staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def import_built_extension(module_name: str, library: Path) -> ModuleType:
    """Import a complete build's module `module_name` from its shared library (torch first: the
    module links against libtorch). The CPU platform's own builder imports its builds with it too."""
    import torch  # noqa: F401

    spec = importlib.util.spec_from_file_location(module_name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _parallel_seam.add_extension(library)
    return module


def publish_parallel_backend(capsule: object) -> None:
    """Run the parallel loops of every extension built with ``<tokenmill/parallel.h>`` (imported
    already or later) on the pool behind ``capsule``, a PyCapsule named ``tokenmill.parallel_backend``
    holding a ``tokenmill_parallel_backend`` that lives as long as the process (parallel_abi.h).
    A platform with a pool of its own calls it once its kernels are loaded; a second call replaces
    the first."""
    _parallel_seam.publish(capsule)


def attached_extensions() -> list[Path]:
    """The extensions whose loops run on the published pool (for tests and diagnostics)."""
    return _parallel_seam.attached()


class _ParallelSeam:
    """The published pool's table and the extensions that can take it, attached through the
    ``tokenmill_parallel_attach`` each exports (ctypes: the extension's library is already loaded,
    so ``RTLD_NOLOAD`` finds it rather than loading a second copy)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._backend: int | None = None  # the table's address
        self._extensions: dict[Path, ctypes.CDLL] = {}
        self._attached: list[Path] = []

    def add_extension(self, library: Path) -> None:
        try:
            handle = ctypes.CDLL(str(library), mode=os.RTLD_NOLOAD | os.RTLD_NOW)
            handle[_ATTACH_SYMBOL]  # raises AttributeError where the extension does not include the header
        except (OSError, AttributeError):
            return  # built without <tokenmill/parallel.h> (the CPU platform's own kernels): nothing to attach
        with self._lock:
            self._extensions[library] = handle
            if self._backend is not None:
                self._attach(library, handle)

    def publish(self, capsule: object) -> None:
        get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
        get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
        try:
            address = get_pointer(capsule, PARALLEL_BACKEND_CAPSULE)
        except ValueError as exc:  # another capsule, or no capsule
            raise ValueError(f"publish_parallel_backend takes a PyCapsule named "
                             f"{PARALLEL_BACKEND_CAPSULE.decode()}, not {capsule!r}") from exc
        with self._lock:
            self._backend = address
            self._attached = []
            for library, handle in self._extensions.items():
                self._attach(library, handle)

    def attached(self) -> list[Path]:
        with self._lock:
            return list(self._attached)

    def _attach(self, library: Path, handle: ctypes.CDLL) -> None:
        attach = handle[_ATTACH_SYMBOL]
        attach.restype, attach.argtypes = ctypes.c_int, [ctypes.c_void_p]
        if attach(self._backend) == 0:
            self._attached.append(library)
        else:
            logger.warning("%s was built for another version of the parallel-loop seam: its loops stay on "
                           "at::parallel_for", library)


_parallel_seam = _ParallelSeam()


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
