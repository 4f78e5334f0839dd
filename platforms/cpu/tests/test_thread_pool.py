"""The kernels' claiming thread pool (kernels/thread_pool.h): the same results as OpenMP's
at::parallel_for, workers per the platform's thread count, and the contention fallback engaging
and releasing. No timing is asserted: whether the fallback pays is
measured by ``tokenmill bench throughput --background-load N``."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from tokenmill_platform_cpu.kernels import kernels_available, load_kernels
from tokenmill_platform_cpu.layer_ops import CpuLayerOps

pytestmark = pytest.mark.skipif(not kernels_available(), reason="no C++ compiler to build the kernels")


@pytest.fixture
def kernels() -> Iterator[object]:
    """The kernels on two pool threads and the claim pool, restored afterwards, the gauge released."""
    kernels = load_kernels()
    threads, torch_threads = kernels.pool_threads(), torch.get_num_threads()
    kernels.set_pool_threads(2)
    yield kernels
    _release(kernels)
    kernels.set_thread_pool("claim")
    kernels.set_pool_threads(threads)
    torch.set_num_threads(torch_threads)


def _release(kernels) -> None:
    for _ in range(2000):
        if not kernels.thread_pool_stats()["contended"]:
            return
        kernels.thread_pool_observe(0.5)
    raise AssertionError("the contention gauge did not release on fair shares")


@contextmanager
def _busy_processes(count: int) -> Iterator[None]:
    """``count`` other processes that always want a core (a pure-Python loop each), for the block."""
    program = "print('busy', flush=True)\nwhile True:\n    pass\n"
    children = [subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, text=True)
                for _ in range(count)]
    try:
        for child in children:
            assert child.stdout is not None and child.stdout.readline().strip() == "busy"
        yield
    finally:
        for child in children:
            child.kill()
            child.wait()


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0))


def _each_kernel(kernels) -> list[torch.Tensor]:
    """Every kernel family that splits its work over the threads, on inputs big enough to split."""
    torch.manual_seed(0)
    ops = CpuLayerOps(kernels, packed_budget=1 << 40)
    x, weight = torch.randn(300, 768), torch.randn(768)
    linear_weight = torch.randn(1000, 768)
    prepared = ops.prepare_linear_weight(linear_weight)
    out = [ops.rms_norm(x, weight, 1e-6), ops.silu_and_mul(torch.randn(97, 2 * 1536)),
           ops.linear(x[:3], linear_weight, None, None), kernels.pack_linear_weight(linear_weight)]
    if prepared is not None:  # the AVX-512 panel kernel
        out.append(ops.linear(x[:32], linear_weight, None, prepared))
    return out


def test_the_claim_pool_gives_openmps_results_bit_for_bit(kernels):
    """Chunks change who computes an output, never how: every element is computed the same way."""
    kernels.set_thread_pool("openmp")
    assert kernels.thread_pool() == "openmp"
    reference = _each_kernel(kernels)
    kernels.set_thread_pool("claim")
    for got, want in zip(_each_kernel(kernels), reference, strict=True):
        assert torch.equal(got, want)


def test_regions_run_on_the_platforms_thread_count_not_torchs(kernels):
    torch.set_num_threads(1)  # what the fallback does to torch: the kernels keep their two threads
    _each_kernel(kernels)
    stats = kernels.thread_pool_stats()
    assert kernels.pool_threads() == stats["threads"] == 2 and stats["workers"] == 1
    with pytest.raises(RuntimeError, match="'claim' or 'openmp'"):
        kernels.set_thread_pool("tbb")


def test_the_contention_fallback_engages_and_releases(kernels):
    """Beside other processes that want every core, fed the caller shares of regions whose workers
    claim nothing, the gauge sets torch to one thread and runs regions on the caller; fed fair
    shares, it gives torch its threads back."""
    _release(kernels)
    torch.set_num_threads(2)
    engaged_before = kernels.thread_pool_stats()["engagements"]
    with _busy_processes(_usable_cores()):
        for _ in range(3000):  # past a pause of the gauge that an earlier test's overruling left
            if kernels.thread_pool_stats()["contended"]:
                break
            kernels.thread_pool_observe(1.0)
    stats = kernels.thread_pool_stats()
    assert stats["contended"] and stats["engagements"] == engaged_before + 1 and stats["caller_share"] > 0.8
    assert stats["others_runnable"] >= _usable_cores() - 1  # beyond the cores the region's two threads leave
    assert torch.get_num_threads() == 1
    kernels.set_thread_pool("openmp")
    reference = _each_kernel(kernels)
    kernels.set_thread_pool("claim")
    for got, want in zip(_each_kernel(kernels), reference, strict=True):  # contended: on the caller alone
        assert torch.equal(got, want)
    _release(kernels)
    assert torch.get_num_threads() == 2 and kernels.thread_pool_stats()["caller_share"] < 0.6


def test_machine_load_counts_other_processes_apart_from_our_own_threads(kernels):
    """The gauge's second opinion: busy children are others' load; busy threads of this process
    (torch ops on two Python threads, the GIL released while they multiply) are ours."""
    stop = threading.Event()

    def multiply() -> None:
        a = torch.randn(256, 256)
        while not stop.is_set():
            torch.mm(a, a)

    threads = [threading.Thread(target=multiply) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        with _busy_processes(2):
            loads = [kernels.machine_load() for _ in range(50)]
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert all(load["runnable"] >= load["ours"] >= 1 for load in loads)  # the reading thread is ours and runs
    # the two children are always runnable (the median: a thread of ours changing state between the
    # two reads of one sample moves that sample by one)
    assert sorted(load["others"] for load in loads)[len(loads) // 2] >= 2
    assert max(load["ours"] for load in loads) >= 2  # a multiplying thread beside the reader


def test_the_gauge_is_overruled_where_no_other_process_wants_the_cores(kernels):
    """Workers that miss their share with no other process runnable were held back by this
    process's own threads (torch's spinning OpenMP team): one thread would be slower, so the
    fallback stays off. Only checkable on a quiet machine."""
    _release(kernels)
    torch.set_num_threads(2)
    spare = _usable_cores() - kernels.pool_threads()
    if max(kernels.machine_load()["others"] for _ in range(20)) > spare:
        pytest.skip("other processes are using the machine's cores")
    overruled_before = kernels.thread_pool_stats()["overruled"]
    for _ in range(3000):
        kernels.thread_pool_observe(1.0)
        if kernels.thread_pool_stats()["overruled"] > overruled_before:
            break
    stats = kernels.thread_pool_stats()
    if stats["others_runnable"] > spare:
        pytest.skip("another process became runnable while the gauge rose")
    assert stats["overruled"] == overruled_before + 1 and not stats["contended"]
    assert torch.get_num_threads() == 2


_PARKING = """
import time, torch
from tokenmill_platform_cpu.kernels import load_kernels
kernels = load_kernels()
kernels.set_pool_threads(2)
kernels.rms_norm(torch.randn(300, 768), torch.randn(768), 1e-6)  # starts the worker; it spins after
def sleeping_within(seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if kernels.thread_pool_stats()["sleeping"] == kernels.thread_pool_stats()["workers"]:
            return True
        time.sleep(0.01)
    return False
print("spinning", not sleeping_within(0.5))
kernels.park_workers()
print("parked", sleeping_within(5.0))
kernels.rms_norm(torch.randn(300, 768), torch.randn(768), 1e-6)  # a region wakes it again
print("awake", not sleeping_within(0.5))
"""


def test_parked_workers_sleep_until_the_next_region():
    """With a spin far longer than the test, a worker is still spinning after its region; parked
    (as a step graph does before each op of torch's own), it sleeps, and the next region wakes it."""
    if _usable_cores() < 2:
        pytest.skip("one usable core: no worker to park")
    env = {**os.environ, "TOKENMILL_CPU_SPIN_US": str(60_000_000), "TOKENMILL_CPU_CONTENTION_FALLBACK": "0"}
    done = subprocess.run([sys.executable, "-c", _PARKING], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["spinning", "True", "parked", "True", "awake", "True"]
