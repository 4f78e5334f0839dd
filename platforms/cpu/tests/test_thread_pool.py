"""The kernels' claiming thread pool (kernels/thread_pool.h): the same results as OpenMP's
at::parallel_for, workers per the platform's thread count, and the contention fallback engaging
and releasing. No timing is asserted: whether the fallback pays is
measured by ``tokenmill bench throughput --background-load N``."""

from __future__ import annotations

from collections.abc import Iterator

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
    """Fed the caller shares of regions whose workers claim nothing, the gauge sets torch to one
    thread and runs regions on the caller; fed fair shares, it gives torch its threads back."""
    _release(kernels)
    torch.set_num_threads(2)
    engaged_before = kernels.thread_pool_stats()["engagements"]
    for _ in range(1000):
        if kernels.thread_pool_stats()["contended"]:
            break
        kernels.thread_pool_observe(1.0)
    stats = kernels.thread_pool_stats()
    assert stats["contended"] and stats["engagements"] == engaged_before + 1 and stats["caller_share"] > 0.8
    assert torch.get_num_threads() == 1
    kernels.set_thread_pool("openmp")
    reference = _each_kernel(kernels)
    kernels.set_thread_pool("claim")
    for got, want in zip(_each_kernel(kernels), reference, strict=True):  # contended: on the caller alone
        assert torch.equal(got, want)
    _release(kernels)
    assert torch.get_num_threads() == 2 and kernels.thread_pool_stats()["caller_share"] < 0.6
