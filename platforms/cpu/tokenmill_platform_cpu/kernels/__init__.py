"""The CPU platform's C++ kernels, compiled once per machine, Python environment and source.

``torch.utils.cpp_extension.load`` builds them with the machine's compiler (and
ninja). ``scripts/install`` triggers the build; otherwise the first engine does,
saying so on the log (see :mod:`.build_progress`). Where no compiler is available,
:func:`load_kernels` returns None and the platform runs the torch reference ops and
the SDPA attention backend instead.

Each build lives in a folder named by what it was built from (the Python
environment and torch version, then the sources, the flags and the CPU), and is
only ever written under a temporary name and renamed into place once complete. So:

- a complete build is loaded as it is, without running ninja: a process whose PATH
  finds another ninja (whose log format differs, which makes ninja start over) or
  another checkout's sources never rebuilds it;
- a build that was killed leaves only a temporary folder, which the next build
  removes; builds take turns under :func:`.build_lock.exclusive`, which the
  operating system releases when its holder dies, so no stale lock is ever waited on;
- a changed source gets a new folder, seeded with the newest previous build's
  objects so that ninja recompiles only what changed.

The build runs the ``ninja`` of the ``ninja`` Python package (a dependency of this
distribution) whatever PATH says, so seeded logs are always read by the ninja that
wrote them.

Why not compile at install time, as a wheel's extension module: the module links
against one torch version's C++ ABI (a wheel per torch release), pip's build
isolation would install a (multi-GB, CUDA) torch just to build it, and a
distributable build cannot use ``-march=native``; the kernels' AVX-512 bodies would
need a second AVX2 build and a run-time dispatch, doubling the compile.

The instruction set is chosen at build time, from the CPU the build runs on: each
vector kernel has an AVX-512 body and an AVX2+FMA body, picked by the compiler's
``__AVX512F__`` / ``__AVX2__``. ``TOKENMILL_CPU_ISA`` (see :data:`ISA_TARGETS`) builds
for a lower level than the CPU's own instead, in a build folder of its own: how an
AVX-512 machine measures what an AVX2-only CPU would run. Asking for a level this CPU
lacks fails (:class:`UnsupportedKernelIsa`) rather than running torch's ops unasked.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

from tokenmill.plugin_api import import_built_extension, native_headers, native_include_dir, publish_parallel_backend
from tokenmill_platform_cpu.kernels import build_lock, build_progress

logger = logging.getLogger(__name__)
MODULE_NAME = "tokenmill_cpu_kernels"
_SOURCES = [Path(__file__).with_name(name)
            for name in ("bindings.cpp", "paged_attention.cpp", "cache_write.cpp", "layer_ops.cpp",
                          "small_matmul.cpp", "panel_matmul.cpp", "sampling.cpp", "step_graph.cpp", "thread_pool.cpp",
                          "thread_binding.cpp", "machine_load.cpp", "lora_delta.cpp",
                          "grouped_moe.cpp")]
_HEADERS = [Path(__file__).with_name(name)
            for name in ("vector_expf.h", "thread_pool.h", "thread_binding.h", "machine_load.h", "vector_avx2.h", "moe_lane_tiles.h")]
# -ffast-math for the reassociated (vectorised) reductions, but not its finite-math
# assumption: error isolation finds a broken request by the NaN or inf in its logits,
# which every kernel on the way to them must carry through, not fold away (and
# vector_expf.h keeps the vector expf that this would otherwise lose).
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-ffast-math", "-fno-finite-math-only"]
LDFLAGS = ["-fopenmp"]
_STAGING_MARK = ".building-"
_CPU_FILE = "cpu-flags"  # in each build: the CPU it was built for
ISA_VARIABLE = "TOKENMILL_CPU_ISA"
NATIVE_ISA = "native"
# TOKENMILL_CPU_ISA's levels: the -march flags that replace -march=native (tuning stays the
# CPU's own) and the /proc/cpuinfo flags the CPU needs to run that build.
ISA_TARGETS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "avx2": (("-march=x86-64-v3", "-mtune=native"), ("avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm")),
    "avx512": (("-march=x86-64-v4", "-mtune=native"),
               ("avx2", "fma", "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")),
    "avx512_bf16": (("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mtune=native"),
                    ("avx2", "fma", "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_bf16",
                     "avx512_vnni")),
}


class UnsupportedKernelIsa(RuntimeError):
    """``TOKENMILL_CPU_ISA`` names no level, or one this CPU cannot run."""


def requested_isa() -> str:
    """``$TOKENMILL_CPU_ISA`` (default ``native``: whatever the build machine's CPU has)."""
    return os.environ.get(ISA_VARIABLE, "").strip().lower() or NATIVE_ISA


def check_isa(isa: str, cpu_flags: str) -> None:
    """Raise :class:`UnsupportedKernelIsa` unless ``isa`` is a level a CPU with these
    ``/proc/cpuinfo`` flags runs."""
    if isa == NATIVE_ISA:
        return
    if isa not in ISA_TARGETS:
        raise UnsupportedKernelIsa(f"{ISA_VARIABLE}={isa!r}: not one of {', '.join([NATIVE_ISA, *ISA_TARGETS])}")
    have = set(cpu_flags.partition(":")[2].split())
    missing = [flag for flag in ISA_TARGETS[isa][1] if flag not in have]
    if missing:
        raise UnsupportedKernelIsa(f"{ISA_VARIABLE}={isa}: this CPU lacks {' '.join(missing)}; "
                                   f"unset it to build for the CPU's own instruction set")


def native_isa(cpu_flags: str) -> str:
    """The highest level of :data:`ISA_TARGETS` a CPU with these flags runs (``-march=native``
    builds for all of its flags; this names which kernel bodies that selects), or ``baseline``."""
    have = set(cpu_flags.partition(":")[2].split())
    runnable = [isa for isa, (_, needs) in ISA_TARGETS.items() if all(flag in have for flag in needs)]
    return runnable[-1] if runnable else "baseline"


def kernel_isa() -> str:
    """The level the kernels are (or will be) built for: ``$TOKENMILL_CPU_ISA`` or, by default,
    the CPU's own (e.g. ``avx512_bf16 (native)``); what ``tokenmill bench`` reports."""
    isa = requested_isa()
    check_isa(isa, _cpu_features())
    return f"{native_isa(_cpu_features())} ({NATIVE_ISA})" if isa == NATIVE_ISA else isa


def compile_flags() -> list[str]:
    """:data:`CFLAGS` with ``-march=native`` replaced by the requested level's flags."""
    isa = requested_isa()
    check_isa(isa, _cpu_features())
    if isa == NATIVE_ISA:
        return list(CFLAGS)
    march = list(ISA_TARGETS[isa][0])
    return [flag for part in CFLAGS for flag in (march if part == "-march=native" else [part])]


def environment_directory() -> Path:
    """``$TOKENMILL_KERNEL_CACHE`` (default ``~/.cache/tokenmill/kernels``), then one folder
    per Python environment and torch version: the builds of that environment lie in it."""
    import torch

    root = Path(os.environ.get("TOKENMILL_KERNEL_CACHE", Path.home() / ".cache" / "tokenmill" / "kernels"))
    environment = hashlib.sha1(f"{sys.prefix}|{torch.__version__}".encode()).hexdigest()[:12]
    return root / f"py{sys.version_info.major}{sys.version_info.minor}-{environment}"


def build_directory() -> Path:
    """The folder of the build for these sources, flags and CPU (complete once it exists)."""
    key = hashlib.sha1()
    for source in _SOURCES + _HEADERS:
        key.update(str(source).encode() + b"\0" + source.read_bytes() + b"\0")
    for header in native_headers():  # the parallel-loop seam's table (thread_pool.cpp fills it)
        key.update(header.read_bytes() + b"\0")
    key.update(" ".join(compile_flags() + LDFLAGS).encode() + b"\0" + _cpu_features().encode())
    return environment_directory() / key.hexdigest()[:16]


def library_path(folder: Path) -> Path:
    return folder / f"{MODULE_NAME}.so"


@functools.cache
def load_kernels() -> ModuleType | None:
    """The kernels, built for :func:`kernel_isa`; None where they cannot be built. A
    ``TOKENMILL_CPU_ISA`` this CPU cannot run raises :class:`UnsupportedKernelIsa`."""
    isa = kernel_isa()  # raises for a level this CPU lacks: asked for, so not silently replaced
    try:
        module = _load_or_build(build_directory())
        logger.info("CPU kernels built for %s", isa)
        # plugin kernels' loops (tokenmill/parallel.h) on this pool too, beside these kernels' own
        publish_parallel_backend(module.parallel_backend())
        return module
    except Exception as exc:  # no compiler, no ninja, unsupported flags: run without the kernels
        logger.warning("CPU kernels unavailable (%s); using the torch reference ops and SDPA attention", exc)
        return None


def kernels_available() -> bool:
    return load_kernels() is not None


def _load_or_build(folder: Path) -> ModuleType:
    if library_path(folder).exists():
        return _import_library(library_path(folder))
    with build_lock.exclusive(folder.parent / "build.lock"):
        if library_path(folder).exists():  # built by the process we waited for
            return _import_library(library_path(folder))
        return _build(folder)


def _import_library(path: Path) -> ModuleType:
    return import_built_extension(MODULE_NAME, path)


def _build(folder: Path) -> ModuleType:
    """Compile into a temporary sibling of ``folder``, then rename it into place. Called
    under the build lock, so every other temporary folder is a dead build's leftover."""
    from torch.utils.cpp_extension import load

    _remove_abandoned_builds(folder.parent)
    staging = Path(tempfile.mkdtemp(prefix=folder.name + _STAGING_MARK, dir=folder.parent))
    try:
        _seed_from_previous_build(staging, folder.parent)
        with _packaged_ninja_first(folder.parent), build_progress.reported(staging, len(_SOURCES)):
            # copies of the flag lists: torch appends its libraries to the ldflags it is given, which
            # would change build_directory()'s key for the rest of this process
            module = load(name=MODULE_NAME, sources=[str(s) for s in _SOURCES], extra_cflags=compile_flags(),
                          extra_ldflags=list(LDFLAGS), extra_include_paths=[str(native_include_dir())],
                          build_directory=str(staging), verbose=False)
        (staging / _CPU_FILE).write_text(_build_target())
        staging.chmod(0o755)  # mkdtemp's folder is the owner's alone
        staging.rename(folder)
        module.__file__ = str(library_path(folder))  # where it now lies (not the temporary name)
        if module.__spec__ is not None:
            module.__spec__.origin = module.__file__
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already if the build succeeded
    return module


def _remove_abandoned_builds(environment: Path) -> None:
    for leftover in environment.glob(f"*{_STAGING_MARK}*"):
        logger.warning("removing %s, left by an interrupted kernel build", leftover)
        shutil.rmtree(leftover, ignore_errors=True)


def _seed_from_previous_build(staging: Path, environment: Path) -> None:
    """Copy the newest complete build's objects and ninja logs (with their times), so
    that ninja recompiles only the sources that changed since. Only a build for this
    CPU and instruction set: ninja cannot tell, ``-march=native`` reads the same for every CPU."""
    builds = [f for f in environment.iterdir()
              if library_path(f).exists() and _read(f / _CPU_FILE) == _build_target()]
    if builds:
        newest = max(builds, key=lambda f: library_path(f).stat().st_mtime)
        shutil.copytree(newest, staging, dirs_exist_ok=True, ignore=shutil.ignore_patterns("lock"))


@contextmanager
def _packaged_ninja_first(environment: Path) -> Iterator[None]:
    """Put the ``ninja`` Python package's binary first on PATH for the build (torch runs
    ``ninja`` from PATH) by a folder holding a link to it alone; without the package,
    PATH's ninja builds."""
    try:
        import ninja

        binary = Path(ninja.BIN_DIR) / "ninja"
    except ImportError:
        binary = None
    if binary is None or not binary.exists():
        yield
        return
    link_folder = environment / "ninja-bin"
    link_folder.mkdir(exist_ok=True)
    link = link_folder / "ninja"
    link.unlink(missing_ok=True)
    link.symlink_to(binary)
    saved = os.environ.get("PATH", "")
    os.environ["PATH"] = str(link_folder) + os.pathsep + saved
    try:
        yield
    finally:
        os.environ["PATH"] = saved


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _cpu_features() -> str:
    """The CPU's feature flags: ``-march=native`` builds for them, so a kernel cache shared
    between machines (a network home) keeps one build per kind of CPU."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith("flags")), "")
    except OSError:
        import platform

        return platform.machine()


def _build_target() -> str:
    """What a build's ``cpu-flags`` file records: the CPU's flags, and the level when it is not the CPU's own."""
    isa = requested_isa()
    return _cpu_features() if isa == NATIVE_ISA else f"{ISA_VARIABLE}={isa}\n{_cpu_features()}"
