"""The CPU paged attention backend through the conformance kit (beside its own kernel
tests in test_paged_attention.py, which cover the AVX-512 head sizes)."""

from __future__ import annotations

import pytest

from tokenmill.testing.attention import AttentionBackendConformance
from tokenmill_platform_cpu.kernels import kernels_available


@pytest.mark.skipif(not kernels_available(), reason="no C++ compiler to build the kernel")
class TestCpuPagedConformance(AttentionBackendConformance):
    backend_name = "cpu-paged"
    # the registered spec (float32, bfloat16; no soft cap) says the rest
