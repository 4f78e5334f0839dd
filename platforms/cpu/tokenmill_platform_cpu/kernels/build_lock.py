"""One kernel build at a time per environment, with a lock that dies with its holder.

torch's own lock (a ``lock`` file it creates and deletes) outlives a build that was
killed (Ctrl-C during the link, a timeout, the OOM killer): every later start then
waits on it forever, saying nothing. This lock is an ``flock`` on a file beside the
builds, which the operating system releases when the holding process ends, however
it ends. The holder writes its pid and start time into the file, so a waiting
process can say whom it waits for.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)
POLL_SECONDS = 0.5
REPORT_EVERY_SECONDS = 30.0


@contextlib.contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """Hold the exclusive lock on ``path`` (created if missing) for the ``with`` body."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by the compiler's processes
    try:
        _acquire(fd, path)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {time.time():.0f}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def _acquire(fd: int, path: Path) -> None:
    """Take the lock, logging every ``REPORT_EVERY_SECONDS`` who holds it and for how long."""
    started = time.monotonic()
    next_report = started  # the first refusal is reported at once
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        now = time.monotonic()
        if now >= next_report:
            logger.warning("waiting for %s to finish building the CPU kernels (waited %.0f s so far; lock %s)",
                           _holder(path), now - started, path)
            next_report = now + REPORT_EVERY_SECONDS
        time.sleep(POLL_SECONDS)


def _holder(path: Path) -> str:
    """"process 1234 (building for 56 s)" from what the holder wrote, or "another process"."""
    try:
        pid, since = path.read_text().split()
        return f"process {int(pid)} (building for {time.time() - float(since):.0f} s)"
    except (OSError, ValueError):  # written a moment after the lock is taken
        return "another process"
