"""The CUDA platform and the SDPA backend on it through the conformance kit. Without a CUDA
GPU the platform must step aside (checked here) and the rest skips; scripts/gpu-check runs
the ``gpu`` tests where one is lent."""

from __future__ import annotations

import pytest
import torch

from tokenmill.testing.attention import AttentionBackendConformance
from tokenmill.testing.platform import PlatformConformance


class TestCudaPlatformConformance(PlatformConformance):
    platform_name = "cuda"

    def device_available(self) -> bool:
        return torch.cuda.is_available() and torch.version.hip is None


@pytest.mark.gpu
class TestSDPAOnCudaConformance(AttentionBackendConformance):
    backend_name = "sdpa"
    device = "cuda"
    dtypes = ("float32", "bfloat16", "float16")
