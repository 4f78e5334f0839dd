"""A platform's optional capabilities are runtime-checkable protocols; a platform without one gets
the core's fallback (zeros on its device, no prefault, no step graphs, no thread warning)."""

from __future__ import annotations

import torch

from tokenmill.config import EngineConfig
from tokenmill.platform import (
    DeviceKVAllocator,
    KVCacheAllocator,
    KVCachePrefault,
    Platform,
    StepGraphCapture,
    ThreadAffine,
    platform_is_thread_affine,
    platform_kv_allocator,
    platform_kv_prefault_bytes,
    platform_step_graph_capture,
)


class BarePlatform:
    """Only the required members of Platform."""

    name = "bare"
    device_type = "cpu"
    dist_backend = "gloo"

    def device(self) -> torch.device:
        return torch.device("cpu")

    def default_dtype(self) -> torch.dtype:
        return torch.float32

    def configure_process(self, config: EngineConfig) -> None:
        pass

    def kv_cache_bytes(self, config: EngineConfig) -> int:
        return 1 << 20

    def synchronize(self) -> None:
        pass


class PrefaultingPlatform(BarePlatform):
    thread_affine = False  # declared, and false: no warning either

    def kv_cache_prefault_bytes(self, config: EngineConfig) -> int:
        return 4096


def test_a_bare_platform_has_no_capability_and_gets_the_fallbacks():
    platform: Platform = BarePlatform()
    for capability in (ThreadAffine, KVCacheAllocator, KVCachePrefault, StepGraphCapture):
        assert not isinstance(platform, capability), capability.__name__
    assert not platform_is_thread_affine(platform)
    assert platform_kv_prefault_bytes(platform, EngineConfig()) == 0
    assert platform_step_graph_capture(platform) is None
    allocator = platform_kv_allocator(platform)
    assert allocator == DeviceKVAllocator(torch.device("cpu"))
    zeros = allocator.allocate_kv_tensor((2, 4, 1, 8), torch.float32)
    assert zeros.shape == (2, 4, 1, 8) and zeros.device.type == "cpu" and not zeros.any()


def test_a_capability_is_used_where_declared():
    platform = PrefaultingPlatform()
    assert isinstance(platform, KVCachePrefault) and isinstance(platform, ThreadAffine)
    assert platform_kv_prefault_bytes(platform, EngineConfig()) == 4096
    assert not platform_is_thread_affine(platform)
    assert not isinstance(platform, KVCacheAllocator)
