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
