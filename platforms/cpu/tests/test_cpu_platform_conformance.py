"""The CPU platform through the conformance kit: always detected, its protocol, its KV
budget, and the tiny Llama generating transformers' greedy tokens on it."""

from __future__ import annotations

from tokenmill.testing.platform import PlatformConformance


class TestCpuPlatformConformance(PlatformConformance):
    platform_name = "cpu"  # device_available: always
