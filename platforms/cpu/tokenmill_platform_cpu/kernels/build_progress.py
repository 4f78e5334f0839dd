"""Lines on the log while the kernels compile, so a first start never looks hung.

A user who installed the platform with pip (not through ``scripts/install``) meets
the build at the first engine: minutes on a small machine. A line at the start says
what is happening and how long it takes, one every ``REPORT_EVERY_SECONDS`` counts
the compiled objects, and one at the end gives the elapsed time. WARNING, because
that is what Python prints when nothing configured logging.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)
REPORT_EVERY_SECONDS = 30.0
TYPICAL_DURATION = "about a minute on 2 idle cores, minutes more on busy ones"


@contextlib.contextmanager
def reported(folder: Path, objects: int) -> Iterator[None]:
    """Report on the build of ``objects`` object files into ``folder`` while the body runs."""
    logger.warning("compiling the CPU kernels, once per environment and kernel version (%s) into %s ...",
                   TYPICAL_DURATION, folder.parent)
    started = time.monotonic()
    done = threading.Event()
    reporter = threading.Thread(target=_report, args=(folder, objects, started, done),
                                name="kernel-build-progress", daemon=True)
    reporter.start()
    try:
        yield
    finally:
        done.set()
        reporter.join()
    logger.warning("compiled the CPU kernels in %.0f s", time.monotonic() - started)


def _report(folder: Path, objects: int, started: float, done: threading.Event) -> None:
    while not done.wait(REPORT_EVERY_SECONDS):
        compiled = sum(1 for _ in folder.glob("*.o"))
        logger.warning("still compiling the CPU kernels: %d of %d objects after %.0f s",
                       compiled, objects, time.monotonic() - started)
