"""The CPU platform: threads from the usable cores, float32 by default, and a
KV cache sized by ``--kv-cache-memory`` (default: a quarter of available RAM,
at most 1 GiB)."""

from __future__ import annotations

import logging
import os

import torch

from tokenmill.config import EngineConfig
from tokenmill.layers import register_layer_ops
from tokenmill_platform_cpu.cores import usable_cores
from tokenmill_platform_cpu.kernels import load_kernels
from tokenmill_platform_cpu.layer_ops import CpuLayerOps

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_CAP = 1 << 30


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


class CpuPlatform:
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"

    def device(self) -> torch.device:
        return torch.device("cpu")

    def default_dtype(self) -> torch.dtype:
        return torch.float32

    def configure_process(self, config: EngineConfig) -> None:
        threads = config.num_threads or int(os.environ.get("TOKENMILL_NUM_THREADS", 0)) or usable_cores()
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        logger.info("CPU platform: %d torch threads", threads)
        kernels = load_kernels()
        if kernels is not None:  # without a compiler the layers keep the torch reference ops
            register_layer_ops("cpu", CpuLayerOps(kernels))

    def kv_cache_bytes(self, config: EngineConfig) -> int:
        if config.kv_cache_memory is not None:
            return config.kv_cache_memory
        return min(DEFAULT_KV_CACHE_CAP, available_memory_bytes() // 4)

    def synchronize(self) -> None:
        pass
