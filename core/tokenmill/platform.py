"""The platform interface and how the engine picks one.

Each platform plugin answers ``tokenmill_detect_platform`` when its device is
present (and logs that it steps aside when not); the available platform of
highest priority wins, or the one ``$TOKENMILL_PLATFORM`` names. A platform
object is small, three protocols every platform has (:class:`Platform`):
device and memory (:class:`DeviceAndMemory`), dtype defaults
(:class:`DtypeDefaults`) and the communication backend
(:class:`CommunicationBackend`).

What only some platforms can do is an optional capability, one small
``runtime_checkable`` protocol each, which the core tests with ``isinstance``
and does without where it is missing: :class:`ThreadAffine`,
:class:`KVCacheAllocator`, :class:`KVCachePrefault`, :class:`StepGraphCapture`
(graph capture), :class:`KernelFeatures` (compute capability, attention
priorities), :class:`ActivationProfiling` and :class:`GroupCommunicator` (its own
collectives for a tensor-parallel group: the CPU's shared-memory ones). The ``platform_*`` functions below are those tests, with the
fallback, so a caller never probes attributes itself.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from tokenmill.errors import PluginError
from tokenmill.plugins.specs import resolve_qualname

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.layers.communicator import Communicator
    from tokenmill.plugins.manager import PluginManager


class DeviceAndMemory(Protocol):
    """The device the model runs on and how much of its memory the KV cache may take."""

    device_type: str

    def device(self) -> torch.device: ...

    def configure_process(self, config: EngineConfig) -> None:
        """Per-process set-up before the model is built (threads, device selection)."""
        ...

    def kv_cache_bytes(self, config: EngineConfig) -> int:
        """Bytes the KV cache may take, called after the model's weights are loaded."""
        ...

    def synchronize(self) -> None: ...


class DtypeDefaults(Protocol):
    """The dtype ``dtype="auto"`` means on this platform (bfloat16 on GPUs, float32 on the CPU)."""

    def default_dtype(self) -> torch.dtype: ...


class CommunicationBackend(Protocol):
    """The torch.distributed backend its ranks talk through (gloo, nccl — RCCL on ROCm —, xccl).
    The tensor-parallel layers' collectives go through it too, unless the platform brings its
    own communicator (:class:`GroupCommunicator`)."""

    dist_backend: str


class Platform(DeviceAndMemory, DtypeDefaults, CommunicationBackend, Protocol):
    """What every platform has: a name, and the three small protocols above. Graph capture
    (:class:`StepGraphCapture`), kernel features (:class:`KernelFeatures`) and the rest
    below are optional capabilities."""

    name: str


# -- optional capabilities ------------------------------------------------------


@runtime_checkable
class ThreadAffine(Protocol):
    """The platform's compute threads belong to the thread that started them (the CPU's
    OpenMP teams), so an engine stepped on another thread than the one that built it is
    slow; the engine core then warns once. Declared as ``thread_affine = True``."""

    thread_affine: bool


@runtime_checkable
class KVCacheAllocator(Protocol):
    """The platform allocates the KV cache's tensors itself (the CPU platform: lazily
    mapped host memory on huge pages, resident only where written). Without it they are
    ``torch.zeros`` on the platform's device."""

    def allocate_kv_tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """One zero-filled K or V tensor of ``shape`` (``[num_blocks, block_size, kv_heads, head_size]``)."""
        ...


@runtime_checkable
class KVCachePrefault(Protocol):
    """The platform's KV tensors are host memory whose pages fault in on first write; the
    runner asks the kernel to populate the first ``kv_cache_prefault_bytes(config)`` of
    each (lowest block ids first) on a background thread at start-up."""

    def kv_cache_prefault_bytes(self, config: EngineConfig) -> int: ...


@runtime_checkable
class DevicePerRank(Protocol):
    """Each tensor-parallel rank needs a device of its own (a GPU): the ``mp`` executor
    refuses more ranks than ``device_count()`` before it starts any. A rank's process
    finds its device from ``LOCAL_RANK``, which the executor sets (torchrun's convention)."""

    def device_count(self) -> int: ...


@runtime_checkable
class KernelFeatures(Protocol):
    """What the platform tells the attention and quantization selectors about its kernels:
    the device's NVIDIA compute capability (``(9, 0)`` on an H100/H200; None where the
    numbers mean nothing, ROCm's and XPU's) and the priority each attention backend takes
    on it (``{"triton": 30}`` on ROCm), overriding the spec's own ``priority``
    (tokenmill.attention.selection)."""

    def compute_capability(self) -> tuple[int, int] | None: ...

    def attention_priorities(self) -> Mapping[str, int]: ...


@runtime_checkable
class ActivationProfiling(Protocol):
    """The platform sizes the KV cache from what a step leaves of the device, so it needs the
    largest step's activation memory first: the worker hands it that step as ``run``
    (tokenmill.worker.memory_profile) and ``measure_peak_bytes`` returns the peak memory
    ``run`` allocated beyond what was held before; ``kv_cache_bytes_after_profile`` is then
    asked instead of ``kv_cache_bytes``. Not asked when ``kv_cache_memory`` is set."""

    def measure_peak_bytes(self, run: Callable[[], object]) -> int: ...

    def kv_cache_bytes_after_profile(self, config: EngineConfig, activation_bytes: int) -> int: ...


class StepGraphUnsupported(Exception):
    """The platform cannot capture this forward (it names the reason); the step runs eagerly."""


class StepGraph(Protocol):
    def replay(self) -> None: ...


@runtime_checkable
class StepGraphCapture(Protocol):
    """The platform records a forward's kernel calls and replays them (tokenmill.worker.step_graphs).
    ``new_graph_pool``: the memory the graphs of one runner share (they never run at
    once), sized for ``max_batch_size``; ``capture_step_graph``: run ``run`` (a forward
    of ``batch_size`` tokens) once and record it, returning the graph and ``run``'s
    output tensors, which every replay rewrites. Raises StepGraphUnsupported. The CPU
    platform records its own kernels and, of a plugin's (a torch op ``ns::name``), calls of
    the op's out overload ``ns::name.out(..., *, Tensor(a!) out)``; an op without one makes
    the capture fail and the step run eagerly."""

    def new_graph_pool(self, max_batch_size: int) -> object: ...

    def capture_step_graph(self, run: Callable[[], tuple[torch.Tensor, ...]], pool: object,
                           batch_size: int) -> tuple[StepGraph, tuple[torch.Tensor, ...]]: ...


@runtime_checkable
class GroupCommunicator(Protocol):
    """The platform brings the :class:`~tokenmill.layers.communicator.Communicator` of each
    tensor-parallel group (a subclass: its collectives by another way than ``dist_backend``,
    such as the CPU's through shared memory between the ranks of one machine). Called by
    every rank of ``group`` at one point while the worker is built (``group``: a
    ``torch.distributed`` group, None for the default one; it may run collectives on it to
    agree), with the rank within the group. Without it: the ``dist_backend`` communicator."""

    def create_communicator(self, rank: int, world_size: int, group: Any) -> Communicator: ...


@dataclass(frozen=True)
class DeviceKVAllocator:
    """The allocation of a platform without :class:`KVCacheAllocator`: zeros on its device."""

    device: torch.device

    def allocate_kv_tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)


def platform_is_thread_affine(platform: Platform) -> bool:
    return isinstance(platform, ThreadAffine) and bool(platform.thread_affine)


def platform_kv_allocator(platform: Platform) -> KVCacheAllocator:
    return platform if isinstance(platform, KVCacheAllocator) else DeviceKVAllocator(platform.device())


def platform_kv_prefault_bytes(platform: Platform, config: EngineConfig) -> int:
    return platform.kv_cache_prefault_bytes(config) if isinstance(platform, KVCachePrefault) else 0


def platform_device_count(platform: Platform) -> int | None:
    """How many ranks the platform has devices for; None: no limit (the CPU's ranks share its cores)."""
    return platform.device_count() if isinstance(platform, DevicePerRank) else None


def platform_communicator(platform: Platform | None, rank: int, world_size: int, group: Any = None) -> Communicator:
    """The tensor-parallel group's communicator: the platform's own (:class:`GroupCommunicator`),
    else the ``torch.distributed`` one over its ``dist_backend``."""
    if platform is not None and isinstance(platform, GroupCommunicator):
        return platform.create_communicator(rank, world_size, group)
    from tokenmill.layers.communicator import Communicator

    return Communicator(rank, world_size, group)


def platform_step_graph_capture(platform: Platform) -> StepGraphCapture | None:
    return platform if isinstance(platform, StepGraphCapture) else None


PLATFORM_ENV = "TOKENMILL_PLATFORM"


def detect_platform(plugins: PluginManager) -> Platform:
    """Instantiate the available platform of highest priority, or the one ``$TOKENMILL_PLATFORM``
    names (an error naming those that can run here when it cannot). A platform plugin whose
    device is absent answers None (and logs that it steps aside)."""
    found = [r.value for r in plugins.collect("tokenmill_detect_platform")]
    if not found:
        raise PluginError("no platform plugin found; install tokenmill-platform-cpu (pip install tokenmill)")
    forced = os.environ.get(PLATFORM_ENV)
    if forced:
        chosen = [spec for spec in found if spec.name == forced]
        if not chosen:
            raise PluginError(f"{PLATFORM_ENV}={forced!r}: that platform cannot run here (not installed, or "
                              f"its device is absent); the ones that can: {sorted(spec.name for spec in found)}")
        best = chosen[0]
    else:
        best = max(found, key=lambda spec: spec.priority)
    logger.debug("platform %s chosen among %s", best.name, [spec.name for spec in found])
    return resolve_qualname(best.qualname)()


def resolve_dtype(config_dtype: str, platform: Platform) -> torch.dtype:
    """``auto`` means the platform's default; anything else is taken literally."""
    if config_dtype == "auto":
        return platform.default_dtype()
    return getattr(torch, config_dtype)
