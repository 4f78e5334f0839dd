"""How much of a GPU this process's KV cache may take, counted per process.

``gpu_memory_utilization`` is the share of the whole device this engine may use. What the
engine already holds is counted from this process's own allocator (``memory_reserved``:
weights, and the peak of anything allocated while they loaded), plus what the process
holds outside torch's allocator (the CUDA context, cuBLAS workspaces), so a second engine
on the same GPU does not count the first one's memory as its own: two engines at 0.45
each fit side by side. What the other processes hold only matters as a limit: the KV
cache cannot take more than is free now (less a margin), and when it would, the error
says who holds the difference.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30
# Kept free for the activations of the largest step and the CUDA graphs' pool, beyond the
# utilisation's own headroom, when nothing measured them.
ACTIVATION_MARGIN = 256 << 20


@dataclass(frozen=True)
class DeviceMemory:
    """One reading of the device and of this process's share of it, in bytes."""

    total: int
    free: int
    torch_reserved: int  # this process's caching allocator
    non_torch: int  # this process outside torch's allocator (context, library workspaces)


def kv_cache_budget(memory: DeviceMemory, utilization: float, activation_bytes: int = ACTIVATION_MARGIN) -> int:
    """Bytes for the KV cache: this process's share of the device less what it already holds
    and what its activations will need; refused when it is not free."""
    own = memory.torch_reserved + memory.non_torch
    budget = int(memory.total * utilization) - own - activation_bytes
    if budget <= 0:
        raise RuntimeError(
            f"no GPU memory left for the KV cache at gpu_memory_utilization={utilization}: this engine holds "
            f"{own / GiB:.2f} GiB of its {memory.total * utilization / GiB:.2f} GiB share already")
    available = memory.free - activation_bytes
    if budget > available:
        others = memory.total - memory.free - own
        raise RuntimeError(
            f"the KV cache needs {budget / GiB:.2f} GiB at gpu_memory_utilization={utilization} but only "
            f"{max(available, 0) / GiB:.2f} GiB is free: other processes hold {others / GiB:.2f} GiB of this GPU; "
            f"lower gpu_memory_utilization or set kv_cache_memory")
    return budget


def read_device_memory(device_index: int) -> DeviceMemory:
    """The device's total and free memory and this process's part of the used memory.

    The process's memory outside torch cannot be asked for directly; it is what the device
    lost since this process started holding memory, less torch's reserved bytes, as recorded
    by :func:`baseline_free` at the first reading."""
    import torch

    torch.cuda.synchronize(device_index)
    free, total = torch.cuda.mem_get_info(device_index)
    reserved = torch.cuda.memory_reserved(device_index)
    return DeviceMemory(total=total, free=free, torch_reserved=reserved,
                        non_torch=max(0, _BASELINE.get(device_index, free + reserved) - free - reserved))


_BASELINE: dict[int, int] = {}


def baseline_free(device_index: int) -> None:
    """Record the free memory before this process allocates on the device (after the CUDA
    context exists: a context costs a few hundred MiB, counted from here as this process's)."""
    import torch

    if device_index not in _BASELINE:
        free, _ = torch.cuda.mem_get_info(device_index)
        _BASELINE[device_index] = free + torch.cuda.memory_reserved(device_index)
