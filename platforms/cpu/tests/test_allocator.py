"""malloc keeps freed activation memory: the next step reuses it without page faults.

Malloc's settings are the whole process's, so each check runs in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tokenmill_platform_cpu.allocator import keep_freed_memory, retain_bytes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")

_FAULTS_OF_A_REUSED_BLOCK = textwrap.dedent("""
    import resource, sys, threading, torch
    from tokenmill_platform_cpu.allocator import keep_freed_memory

    def fill_and_free(nbytes):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = torch.empty(nbytes, dtype=torch.uint8)
        block.fill_(1)
        del block
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    tuned = sys.argv[1] == "tuned" and keep_freed_memory(1 << 30)
    # The heap takes a few rounds to settle (small blocks allocated in between can take a
    # freed block's place, so the next big one extends the heap once more); then it reuses.
    for _ in range(10):
        fill_and_free(48 << 20)  # above glibc's largest mmap threshold (32 MiB)
    faults = sum(fill_and_free(48 << 20) for _ in range(5))
    sums = []  # a thread's arena holds 64 MiB at most: bigger blocks must still come from somewhere
    worker = threading.Thread(target=lambda: sums.append(int(torch.ones(100 << 20, dtype=torch.uint8).sum())))
    worker.start()
    worker.join()
    print(tuned, faults, sums == [100 << 20])
""")


def _run(mode: str) -> tuple[bool, int, bool]:
    out = subprocess.run([sys.executable, "-c", _FAULTS_OF_A_REUSED_BLOCK, mode], capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    return out[0] == "True", int(out[1]), out[2] == "True"


def test_freed_large_blocks_are_reused_without_page_faults():
    tuned, faults, thread_ok = _run("tuned")
    if not tuned:
        pytest.skip("not glibc")
    round_pages = (48 << 20) // 4096
    assert faults < round_pages // 2 and thread_ok  # five rounds, not even half a round of faults
    _, untuned_faults, _ = _run("default")
    assert untuned_faults > 4 * round_pages  # what the setting is for: a fault per 4 KiB page, every round


def test_retain_zero_leaves_malloc_alone(monkeypatch):
    assert keep_freed_memory(0) is False
    monkeypatch.setenv("TOKENMILL_MALLOC_RETAIN", "0")
    assert retain_bytes() == 0
    monkeypatch.setenv("TOKENMILL_MALLOC_RETAIN", "2GiB")
    assert retain_bytes() == 2 << 30
