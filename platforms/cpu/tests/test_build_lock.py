"""The kernel build lock: a waiter names the holder, and the lock dies with its holder."""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import subprocess
import sys
import threading
import time

from tokenmill_platform_cpu.kernels import build_lock


def _wait_for(condition, limit_s: float = 60) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _free(path) -> bool:
    with open(path) as probe:
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True  # released on close


def _take_in_thread(path, taken: threading.Event) -> threading.Thread:
    def take() -> None:
        with build_lock.exclusive(path):
            taken.set()

    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    return thread


def test_a_waiter_says_whom_it_waits_for_and_gets_the_lock_when_it_is_released(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(build_lock, "POLL_SECONDS", 0.01)
    path, taken = tmp_path / "build.lock", threading.Event()
    with caplog.at_level(logging.WARNING, logger=build_lock.__name__), build_lock.exclusive(path):
        waiter = _take_in_thread(path, taken)  # another open file: flock makes it wait, even in this process
        _wait_for(lambda: "waiting for process" in caplog.text)
        assert f"process {os.getpid()} (building for" in caplog.text
        assert not taken.is_set()
    waiter.join(timeout=60)
    assert taken.is_set()


def test_the_lock_of_a_killed_holder_is_free(tmp_path):
    path, taken = tmp_path / "build.lock", threading.Event()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path\n"
         "from tokenmill_platform_cpu.kernels import build_lock\n"
         "with build_lock.exclusive(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(600)", str(path)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert not _free(path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    waiter = _take_in_thread(path, taken)
    waiter.join(timeout=60)
    assert taken.is_set()
