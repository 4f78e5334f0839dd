"""The CUDA platform: one device per process, bfloat16 by default, and a KV
cache sized from free device memory times ``gpu_memory_utilization``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import MappingProxyType

import torch

from tokenmill.plugin_api import EngineConfig

# FlashAttention first where its compute capability and block size allow, then FlashInfer, then
# the portable Triton kernel; SDPA (the reference) last. Backends not named keep their own priority.
CUDA_ATTENTION_PRIORITIES: Mapping[str, int] = MappingProxyType(
    {"flash-attn": 40, "flashinfer": 30, "triton": 20, "sdpa": 0})


class CudaPlatform:
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"

    def __init__(self, device_index: int | None = None) -> None:
        # a tensor-parallel rank's process is told its device by LOCAL_RANK (set by the mp executor)
        self.device_index = int(os.environ.get("LOCAL_RANK", 0)) if device_index is None else device_index

    def device_count(self) -> int:
        """One rank per GPU (NCCL runs no two ranks on one device)."""
        return torch.cuda.device_count()

    def device(self) -> torch.device:
        return torch.device("cuda", self.device_index)

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16

    def configure_process(self, config: EngineConfig) -> None:
        torch.cuda.set_device(self.device_index)

    def kv_cache_bytes(self, config: EngineConfig) -> int:
        """An explicit ``kv_cache_memory`` wins (as vLLM's ``kv_cache_memory_bytes``);
        otherwise what the utilisation fraction leaves once weights and activations are in."""
        if config.kv_cache_memory is not None:
            return config.kv_cache_memory
        torch.cuda.synchronize(self.device_index)
        free, total = torch.cuda.mem_get_info(self.device_index)
        budget = total * config.gpu_memory_utilization - (total - free)
        if budget <= 0:
            raise RuntimeError(
                f"no GPU memory left for the KV cache at gpu_memory_utilization={config.gpu_memory_utilization}"
            )
        return int(budget)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device_index)

    # -- KernelFeatures: what the attention and quantization selectors are told --

    def compute_capability(self) -> tuple[int, int] | None:
        major, minor = torch.cuda.get_device_capability(self.device_index)
        return (major, minor)

    def attention_priorities(self) -> Mapping[str, int]:
        return CUDA_ATTENTION_PRIORITIES
