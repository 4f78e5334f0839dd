"""CUDA platform detection. The engine's GPU tests live in tests/test_cuda_engine.py
(they need the tiny-model fixtures) and run where a CUDA GPU is (scripts/gpu-check)."""

from __future__ import annotations

import torch

from tokenmill.plugins import get_plugin_manager


def test_detection_matches_torch():
    manager = get_plugin_manager()
    found = {r.value.name for r in manager.collect("tokenmill_detect_platform")}
    assert ("cuda" in found) == (torch.cuda.is_available() and torch.version.hip is None)
    assert "cpu" in found


def test_kv_tensors_fall_back_to_zeros_on_the_device():
    """The CUDA platform declares none of the CPU's host-memory capabilities (no device needed to check)."""
    from tokenmill.platform import DeviceKVAllocator, platform_is_thread_affine, platform_kv_allocator
    from tokenmill_platform_cuda.platform import CudaPlatform

    platform = CudaPlatform(device_index=1)
    assert platform_kv_allocator(platform) == DeviceKVAllocator(torch.device("cuda", 1))
    assert not platform_is_thread_affine(platform)


def test_without_a_device_the_platform_steps_aside_with_a_log_line(caplog):
    import logging

    from tokenmill_platform_cuda import tokenmill_detect_platform

    with caplog.at_level(logging.INFO, logger="tokenmill_platform_cuda"):
        spec = tokenmill_detect_platform()
    if torch.cuda.is_available() and torch.version.hip is None:
        assert spec is not None and spec.name == "cuda"
    elif torch.version.hip is None:
        assert spec is None and "platform cuda is installed but steps aside" in caplog.text
