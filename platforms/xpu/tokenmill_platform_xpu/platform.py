"""The Intel XPU platform: one XPU per process, bfloat16 by default, the KV cache sized from
the device's free memory times ``gpu_memory_utilization``, XCCL (torch's own) or oneCCL
(``ccl``, from oneccl-bindings-for-pytorch) for torch.distributed. SDPA runs the attention
(torch's XPU kernels); intel-extension-for-pytorch is loaded at process set-up only when it
matches torch (:mod:`tokenmill_platform_xpu.ipex`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import MappingProxyType

import torch

from tokenmill.plugin_api import EngineConfig
from tokenmill_platform_xpu.ipex import load_ipex

XPU_ATTENTION_PRIORITIES: Mapping[str, int] = MappingProxyType({"sdpa": 0})


def distributed_backend() -> str:
    """XCCL where this torch has it (2.8 and up, XPU builds), else oneCCL's ``ccl``."""
    import torch.distributed as dist

    available = getattr(dist, "is_xccl_available", None)
    return "xccl" if available is not None and available() else "ccl"


class XpuPlatform:
    name = "xpu"
    device_type = "xpu"

    def __init__(self, device_index: int | None = None) -> None:
        self.device_index = int(os.environ.get("LOCAL_RANK", 0)) if device_index is None else device_index
        self.dist_backend = distributed_backend()

    def device_count(self) -> int:
        return torch.xpu.device_count()

    def device(self) -> torch.device:
        return torch.device("xpu", self.device_index)

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def configure_process(self, config: EngineConfig) -> None:
        torch.xpu.set_device(self.device_index)
        load_ipex()

    def kv_cache_bytes(self, config: EngineConfig) -> int:
        if config.kv_cache_memory is not None:
            return config.kv_cache_memory
        torch.xpu.synchronize(self.device_index)
        free, total = torch.xpu.mem_get_info(self.device_index)
        budget = total * config.gpu_memory_utilization - (total - free)
        if budget <= 0:
            raise RuntimeError(
                f"no XPU memory left for the KV cache at gpu_memory_utilization={config.gpu_memory_utilization}")
        return int(budget)

    def synchronize(self) -> None:
        torch.xpu.synchronize(self.device_index)

    def compute_capability(self) -> tuple[int, int] | None:
        return None

    def attention_priorities(self) -> Mapping[str, int]:
        return XPU_ATTENTION_PRIORITIES
