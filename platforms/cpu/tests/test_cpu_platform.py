"""The CPU platform: cores from affinity and cgroup quota, KV budget, threads."""

from __future__ import annotations

import os

import pytest
import torch

from tokenmill.config import EngineConfig
from tokenmill_platform_cpu.cores import cgroup_quota_cores, usable_cores
from tokenmill_platform_cpu.platform import CpuPlatform


def test_cgroup_v2_quota_caps_the_cores(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_quota_cores(tmp_path) == 1.5
    assert usable_cores(tmp_path) == 1


def test_cgroup_v2_without_a_quota(tmp_path):
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_quota_cores(tmp_path) is None
    assert usable_cores(tmp_path) == len(os.sched_getaffinity(0))


def test_cgroup_v1_quota(tmp_path):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("400000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_quota_cores(tmp_path) == 4.0
    assert usable_cores(tmp_path) == min(4, len(os.sched_getaffinity(0)))


def test_affinity_limits_the_cores(tmp_path):
    original = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(original)})
        assert usable_cores(tmp_path) == 1
    finally:
        os.sched_setaffinity(0, original)


def test_threads_and_kv_budget():
    platform = CpuPlatform()
    before = torch.get_num_threads()
    try:
        platform.configure_process(EngineConfig(num_threads=1))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert platform.kv_cache_bytes(EngineConfig(kv_cache_memory="3MiB")) == 3 << 20
    assert 0 < platform.kv_cache_bytes(EngineConfig()) <= 1 << 30
    assert platform.default_dtype() == torch.float32


def test_kv_prefault_is_bounded_by_the_budget(monkeypatch):
    platform = CpuPlatform()
    assert platform.kv_cache_prefault_bytes(EngineConfig(kv_cache_memory="1GiB")) == 256 << 20
    assert platform.kv_cache_prefault_bytes(EngineConfig(kv_cache_memory="32MiB")) == 32 << 20
    monkeypatch.setenv("TOKENMILL_KV_PREFAULT", "0")
    assert platform.kv_cache_prefault_bytes(EngineConfig(kv_cache_memory="1GiB")) == 0
    monkeypatch.setenv("TOKENMILL_KV_PREFAULT", "a lot")
    with pytest.raises(ValueError, match="not a memory size"):
        platform.kv_cache_prefault_bytes(EngineConfig())


def test_packed_weights_budget(monkeypatch):
    from tokenmill_platform_cpu.platform import packed_weights_budget

    assert packed_weights_budget() > 0
    monkeypatch.setenv("TOKENMILL_PACKED_WEIGHTS", "0")
    assert packed_weights_budget() == 0
    monkeypatch.setenv("TOKENMILL_PACKED_WEIGHTS", "2GiB")
    assert packed_weights_budget() == 2 << 30


def test_declares_every_optional_capability():
    from tokenmill.platform import (
        KVCacheAllocator,
        KVCachePrefault,
        StepGraphCapture,
        ThreadAffine,
        platform_is_thread_affine,
        platform_kv_allocator,
        platform_step_graph_capture,
    )

    platform = CpuPlatform()
    for capability in (ThreadAffine, KVCacheAllocator, KVCachePrefault, StepGraphCapture):
        assert isinstance(platform, capability), capability.__name__
    assert platform_is_thread_affine(platform)
    assert platform_kv_allocator(platform) is platform
    assert platform_step_graph_capture(platform) is platform


def test_kv_tensors_are_lazy_zeros_on_huge_page_boundaries():
    import mmap

    from tokenmill.worker.host_memory import HUGE_PAGE

    tensor = CpuPlatform().allocate_kv_tensor((4, 16, 2, 8), torch.bfloat16)
    assert tensor.shape == (4, 16, 2, 8) and tensor.dtype == torch.bfloat16
    assert not tensor.any()
    if hasattr(mmap, "MADV_HUGEPAGE"):  # its own mapping, aligned for huge pages: not a torch.zeros block
        assert tensor.data_ptr() % HUGE_PAGE == 0
