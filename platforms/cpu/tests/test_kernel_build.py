"""The kernel build survives being killed, and a complete build is never redone for a
different ninja on PATH. Both run real builds and loads in subprocesses, each with the
kernel cache it is given; the first compiles the kernels from scratch (minutes on a
small machine)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tokenmill_platform_cpu.kernels import (
    build_directory,
    environment_directory,
    kernels_available,
    library_path,
    load_kernels,
)

pytestmark = pytest.mark.skipif(not kernels_available(), reason="no C++ compiler to build the kernels")
LOAD = "from tokenmill_platform_cpu.kernels import load_kernels; print('loaded' if load_kernels() else 'none')"
BUILD_LIMIT_S = 1200  # a cold build on a loaded 2-core machine, with room to spare


def _environment(cache: Path, path_first: Path | None = None) -> dict[str, str]:
    env = dict(os.environ, TOKENMILL_KERNEL_CACHE=str(cache))
    if path_first is not None:
        env["PATH"] = f"{path_first}{os.pathsep}{env.get('PATH', '')}"
    return env


def _foreign_ninja(folder: Path) -> tuple[Path, Path]:
    """A ``ninja`` of another version that records being run and fails: (its folder, its record)."""
    folder.mkdir()
    record = folder / "ran"
    script = folder / "ninja"
    script.write_text(f"#!/bin/sh\necho \"$@\" >> {record}\n[ \"$1\" = --version ] && echo 1.0.0 && exit 0\nexit 1\n")
    script.chmod(0o755)
    return folder, record


def _wait_for(condition, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


@pytest.mark.long  # a whole kernel build from scratch: ~150 s of the CI's 30 minutes
def test_a_start_after_a_killed_build_builds_instead_of_waiting(tmp_path):
    """The build is killed once torch has taken its own lock (SIGKILL to its process group, as
    ``timeout -s KILL`` does: nothing can clean up); the next start must neither wait on that lock nor need PATH's
    ninja (a foreign one here, which fails): it builds with the packaged ninja and loads."""
    cache = tmp_path / "cache"
    builder = subprocess.Popen([sys.executable, "-c", LOAD], env=_environment(cache), start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for(lambda: any(cache.glob("*/*.building-*/lock")), 120)  # torch's lock, mid-build
    finally:
        os.killpg(builder.pid, signal.SIGKILL)  # python, ninja and the compilers
        builder.wait()
    killed = list(cache.glob("*/*.building-*"))
    assert len(killed) == 1 and (killed[0] / "lock").exists(), "the killed build left its folder and torch's lock"

    ninja_folder, ninja_record = _foreign_ninja(tmp_path / "foreign-ninja")
    restart = subprocess.Popen([sys.executable, "-c", LOAD], env=_environment(cache, ninja_folder),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: not any(folder.exists() for folder in killed), 120)  # cleared, not waited on
        out, err = restart.communicate(timeout=BUILD_LIMIT_S)
    finally:
        restart.kill()
    assert restart.returncode == 0, err
    assert out.strip() == "loaded", err
    assert "interrupted kernel build" in err and "compiled the CPU kernels" in err
    assert library_path(next(cache.glob("*/" + build_directory().name))).exists()
    assert not list(cache.glob("*/*.building-*")), "a temporary build folder is left"
    assert not ninja_record.exists(), "PATH's ninja ran the build"


def test_a_different_ninja_on_path_does_not_rebuild(tmp_path):
    """This process's build (in the cache the tests run with) is loaded by a process whose PATH
    finds a ninja of another version: the library is loaded as it is, no ninja runs."""
    assert load_kernels() is not None
    library = library_path(build_directory())
    built_at = library.stat().st_mtime_ns
    ninja_folder, ninja_record = _foreign_ninja(tmp_path / "foreign-ninja")
    started = subprocess.run([sys.executable, "-c", LOAD], env=_environment(environment_directory().parent,
                                                                            ninja_folder),
                             capture_output=True, text=True, timeout=120)
    assert started.stdout.strip() == "loaded", started.stderr
    assert "compiling" not in started.stderr
    assert library.stat().st_mtime_ns == built_at
    assert not ninja_record.exists()
