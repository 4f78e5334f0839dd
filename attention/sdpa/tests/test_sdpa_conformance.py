"""The SDPA reference backend through the conformance kit: every case against the
float64 definition and the cache writes (the comparison with the SDPA reference is
its own output, so the kit leaves it out here)."""

from __future__ import annotations

from tokenmill.testing.attention import AttentionBackendConformance


class TestSDPAConformance(AttentionBackendConformance):
    backend_name = "sdpa"
    dtypes = ("float32", "bfloat16", "float16")
