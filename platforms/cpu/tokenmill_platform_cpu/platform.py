"""The CPU platform: threads from the usable cores, float32 by default, a KV
cache sized by ``--kv-cache-memory`` (default: a quarter of available RAM, at
most 1 GiB), its kernels registered as layer ops and sampling kernels, small
decode batches replayed as step graphs (see step_graph), and malloc told to keep
freed memory for the next step (see allocator).

Beside tokenmill.plugin_api.Platform it has every optional capability there:
ThreadAffine, KVCacheAllocator, KVCachePrefault, StepGraphCapture and
GroupCommunicator (tensor-parallel ranks of one machine meet in shared memory,
see shm_communicator; gloo where they cannot)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tokenmill.layers import Communicator, register_layer_ops
from tokenmill.plugin_api import (
    EngineConfig,
    StepGraph,
    StepGraphUnsupported,
    lazy_zeros,
    parse_size,
    register_sampling_kernels,
)
from tokenmill_platform_cpu.allocator import keep_freed_memory, retain_bytes
from tokenmill_platform_cpu.cores import usable_cores
from tokenmill_platform_cpu.kernels import load_kernels
from tokenmill_platform_cpu.layer_ops import CpuLayerOps
from tokenmill_platform_cpu.sampling import CpuSamplingKernels
from tokenmill_platform_cpu.shm_communicator import create_shm_communicator
from tokenmill_platform_cpu.step_graph import capture_step_graph

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_CAP = 1 << 30
DEFAULT_KV_PREFAULT = "256MiB"


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def packed_weights_budget() -> int:
    """Memory the packed copies of linear weights may take: ``TOKENMILL_PACKED_WEIGHTS``
    (``0`` disables packing), by default a quarter of available RAM."""
    configured = os.environ.get("TOKENMILL_PACKED_WEIGHTS")
    return parse_size(configured) if configured is not None else available_memory_bytes() // 4


def _log_binding(pool: dict, threads: int) -> None:
    """Where the kernels' regions run (kernels/thread_binding.h): binding never runs more threads
    than it has cores to bind them to."""
    if pool["threads"] < threads:
        logger.warning("CPU platform: TOKENMILL_CPU_BIND=%s has cores for %d of the %d threads asked for: the "
                       "kernels' regions run on %d", pool["binding"], pool["threads"], threads, pool["threads"])
    if pool["cores"]:
        logger.info("CPU platform: the kernels' threads on cores %s (TOKENMILL_CPU_BIND=%s; the first, the "
                    "calling thread's, is not pinned)", pool["cores"], pool["binding"])
    else:
        logger.info("CPU platform: the kernels' threads not pinned (TOKENMILL_CPU_BIND=%s)", pool["binding"])


class CpuPlatform:
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    # torch's OpenMP runtime keeps a worker team per thread that starts parallel work; with
    # more workers than cores they sleep between kernels, so an engine stepped on another
    # thread than the one that built it is 1.5-1.8x slower (the engine core warns).
    thread_affine = True
    cgroup_root = Path("/sys/fs/cgroup")  # where the CPU quota is read (tests point it at a fake tree)

    def device(self) -> torch.device:
        return torch.device("cpu")

    def default_dtype(self) -> torch.dtype:
        return torch.float32

    def configure_process(self, config: EngineConfig) -> None:
        threads = config.num_threads or int(os.environ.get("TOKENMILL_NUM_THREADS", 0)) or usable_cores(self.cgroup_root)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        logger.info("CPU platform: %d torch threads", threads)
        keep_freed_memory(retain_bytes())
        kernels = load_kernels()
        if kernels is not None:  # without a compiler the torch reference ops run
            # the kernels' regions keep this count while the contention fallback lowers torch's
            kernels.set_pool_threads(threads)
            _log_binding(kernels.thread_pool_stats(), threads)  # a malformed TOKENMILL_CPU_BIND fails here
            register_layer_ops("cpu", CpuLayerOps(kernels, packed_weights_budget()))
            register_sampling_kernels("cpu", CpuSamplingKernels(kernels))

    def kv_cache_bytes(self, config: EngineConfig) -> int:
        if config.kv_cache_memory is not None:
            return config.kv_cache_memory
        return min(DEFAULT_KV_CACHE_CAP, available_memory_bytes() // 4)

    def kv_cache_prefault_bytes(self, config: EngineConfig) -> int:
        """The KV cache is mapped lazily, so blocks never written cost no memory; but the
        first write to each page is a page fault, 5-15 µs each on these VMs (~5% of a
        throughput run). The first ``TOKENMILL_KV_PREFAULT`` bytes (default 256 MiB) are
        faulted in on a background thread at start-up (tokenmill.worker.prefault), which
        holds memory the first few hundred sequences would take anyway."""
        wanted = parse_size(os.environ.get("TOKENMILL_KV_PREFAULT", DEFAULT_KV_PREFAULT))
        return min(wanted, self.kv_cache_bytes(config))

    def allocate_kv_tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Zeros resident only where written, on transparent huge pages (tokenmill's
        lazy_zeros): a generous budget costs nothing up front, and decode steps, which read
        blocks scattered over the whole cache, miss the TLB less."""
        return lazy_zeros(shape, dtype, huge_pages=True)

    def new_graph_pool(self, max_batch_size: int) -> object:
        kernels = load_kernels()
        return kernels.GraphPool(max_batch_size) if kernels is not None else None

    def capture_step_graph(self, run: Callable[[], tuple[torch.Tensor, ...]], pool: object,
                           batch_size: int) -> tuple[StepGraph, tuple[torch.Tensor, ...]]:
        kernels = load_kernels()
        if kernels is None or pool is None:
            raise StepGraphUnsupported("the CPU kernels are not built")
        return capture_step_graph(kernels, run, pool, batch_size)

    def create_communicator(self, rank: int, world_size: int, group: Any) -> Communicator:
        """Shared-memory collectives where every rank of ``group`` is on this machine (and
        ``TOKENMILL_CPU_SHM_COMM`` is not 0), else gloo's."""
        return create_shm_communicator(rank, world_size, group)

    def synchronize(self) -> None:
        pass
