"""Busy neighbours for the contention benchmark (``--background-load N``).

Most CPU inference shares its machine: an application beside it, neighbours in a container, a
build. ``bench throughput`` and ``bench latency`` measure that case by running the same workload
twice, first on a quiet machine, then with N busy processes of a fixed kind started for the run,
and report the loaded figures beside the quiet ones. Each busy process takes one core's worth of
work and no more (one thread), so N says how many cores the neighbours want:

- ``matmul``: a numpy float32 matmul loop, a neighbour that also streams through caches and
  the vector units (an ML job, a numeric service);
- ``python``: a pure-Python loop, a neighbour that only wants the core (an application server).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

# Each program prints one line once it is about to loop, so the measured run starts loaded.
BUSY_PROGRAMS = {
    "matmul": ("import numpy as np\n"
               "a = np.random.default_rng(0).random((384, 384), dtype=np.float32)\n"
               "print('busy', flush=True)\n"
               "while True:\n"
               "    a = (a @ a) * np.float32(1e-3)\n"),
    "python": ("print('busy', flush=True)\n"
               "n = 0\n"
               "while True:\n"
               "    n = (n * 1103515245 + 12345) % 2147483648\n"),
}
_ONE_THREAD = {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}


def check_kind(kind: str) -> str:
    if kind not in BUSY_PROGRAMS:
        raise ValueError(f"--background-kind must be one of {', '.join(BUSY_PROGRAMS)}, not {kind!r}")
    return kind


@contextmanager
def background_load(count: int, kind: str = "matmul") -> Iterator[list[subprocess.Popen[str]]]:
    """``count`` busy processes of ``kind`` running for the ``with`` block, stopped after it
    (killed if they do not stop on SIGTERM), even when the block raises."""
    program = BUSY_PROGRAMS[check_kind(kind)]
    env = {**os.environ, **_ONE_THREAD}
    processes: list[subprocess.Popen[str]] = []
    try:
        for _ in range(count):
            processes.append(subprocess.Popen([sys.executable, "-c", program], env=env, text=True,
                                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE))
        for process in processes:
            if process.stdout is None or process.stdout.readline().strip() != "busy":
                raise RuntimeError(f"a {kind} background process (pid {process.pid}) did not start")
        yield processes
    finally:
        _stop(processes)


def _stop(processes: list[subprocess.Popen[str]]) -> None:
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()

