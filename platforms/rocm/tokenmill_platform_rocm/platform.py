"""The ROCm platform: HIP devices through ``torch.cuda`` (torch maps its CUDA API to HIP),
RCCL through torch.distributed's ``nccl`` backend, bfloat16 by default, and the Triton
attention kernel as the default backend. AMD's compute capabilities are not NVIDIA's
numbers, so none is reported: backends that need one (FlashAttention 2's CUDA build,
FlashInfer) are passed over."""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import MappingProxyType

import torch

from tokenmill.plugin_api import EngineConfig

# Triton is the portable GPU kernel and the default here; SDPA is the reference.
ROCM_ATTENTION_PRIORITIES: Mapping[str, int] = MappingProxyType({"triton": 30, "sdpa": 0})


class RocmPlatform:
    name = "rocm"
    device_type = "cuda"  # torch addresses HIP devices as "cuda"
    dist_backend = "nccl"  # RCCL answers to torch.distributed's nccl backend on ROCm

    def __init__(self, device_index: int | None = None) -> None:
        self.device_index = int(os.environ.get("LOCAL_RANK", 0)) if device_index is None else device_index

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def device(self) -> torch.device:
        return torch.device("cuda", self.device_index)

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def configure_process(self, config: EngineConfig) -> None:
        torch.cuda.set_device(self.device_index)

    def kv_cache_bytes(self, config: EngineConfig) -> int:
        """An explicit ``kv_cache_memory`` wins; otherwise what the utilisation fraction leaves."""
        if config.kv_cache_memory is not None:
            return config.kv_cache_memory
        torch.cuda.synchronize(self.device_index)
        free, total = torch.cuda.mem_get_info(self.device_index)
        budget = total * config.gpu_memory_utilization - (total - free)
        if budget <= 0:
            raise RuntimeError(
                f"no GPU memory left for the KV cache at gpu_memory_utilization={config.gpu_memory_utilization}")
        return int(budget)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device_index)

    def compute_capability(self) -> tuple[int, int] | None:
        return None

    def attention_priorities(self) -> Mapping[str, int]:
        return ROCM_ATTENTION_PRIORITIES
