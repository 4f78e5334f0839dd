"""What the machine did: peak memory, process start time, and quick measures
of its matmul peak (the throughput roofline's ceiling) and of how fast it reads
a working set the size of a decode step's weights (the latency one's)."""

from __future__ import annotations

import os
import resource
import sys
import time
from typing import Any

_IMPORTED_AT = time.time()  # the fallback start time where /proc is missing


def peak_rss_bytes() -> int:
    """This process's peak resident set size since it started its program: ``VmHWM`` of
    /proc/self/status where there is one, else ru_maxrss (KiB on Linux, bytes on macOS). Linux
    carries ru_maxrss over an exec from the process that forked it, so a benchmark started by a
    larger process (scripts/bench_quant.py after writing a checkpoint) reported that one's peak."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def peak_device_memory_bytes() -> int | None:
    """The CUDA caching allocator's peak, or None where no GPU was used."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.max_memory_allocated())


def process_start_time() -> float:
    """When this process started, in ``time.time()`` seconds.

    Linux gives the start in clock ticks since boot and the uptime in
    seconds (both about 10 ms resolution); their difference is the age.
    Elsewhere, the time this module was imported stands in for it.
    """
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the command name may hold spaces
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        started_after_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat(5)
        return time.time() - (uptime - started_after_boot)
    except (OSError, ValueError, IndexError):
        return _IMPORTED_AT


def wall_time(perf_time: float) -> float:
    """A ``time.perf_counter()`` reading as ``time.time()`` seconds."""
    return time.time() - (time.perf_counter() - perf_time)


def measure_peak_gflops(device: Any, dtype: Any = None, seconds: float = 0.3) -> float:
    """Matmul GFLOP/s on ``device`` in ``dtype`` (the run's; default float32): big square
    products, timed for about ``seconds``. A bfloat16 run has its own ceiling (AMX on the
    CPU, tensor cores on GPUs), so it is measured in bfloat16.

    A single square matmul is the best case a dense model can reach, so it
    stands in for the machine's peak; pass ``--peak-gflops`` for a datasheet number.
    """
    import torch

    size = 4096 if torch.device(device).type == "cuda" else 1024
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # true float32: no TF32 on GPUs
    try:
        return _time_matmuls(torch, device, dtype or torch.float32, size, seconds)
    finally:
        torch.set_float32_matmul_precision(precision)


def _time_matmuls(torch: Any, device: Any, dtype: Any, size: int, seconds: float) -> float:
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    rate = _calls_per_second(torch, device, lambda: torch.mm(a, b, out=out), seconds)
    return 2 * size**3 * rate / 1e9


# A bigger working set reads at DRAM speed like this one, and the buffer is real memory.
_READ_BUFFER_CAP = 1 << 30


def measure_read_gbps(device: Any, num_bytes: int, seconds: float = 0.3) -> float:
    """GB/s of whole reads (a sum) of a ``num_bytes`` buffer (at most 1 GiB) on ``device``,
    repeated for about ``seconds``: what this machine's memory gives a working set the
    size of one decode step's weights, from cache where it fits, from DRAM where not.
    A decode step reads each weight once, so this bounds batch-1 decode from above."""
    import torch

    elements = max(1, min(num_bytes, _READ_BUFFER_CAP) // 4)
    buffer = torch.ones(elements, device=device)
    return elements * 4 * _calls_per_second(torch, device, buffer.sum, seconds) / 1e9


def _calls_per_second(torch: Any, device: Any, call: Any, seconds: float) -> float:
    """How many times a second ``call`` runs on ``device``, after two warm-up calls (thread
    pools, kernels, caches, first-touch page faults), timed for about ``seconds``."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    for _ in range(2):
        call()
    sync()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        call()
        count += 1
        if count % 4 == 0:  # keep the GPU's queue short, so the loop's clock stays honest
            sync()
    sync()
    return count / (time.perf_counter() - start)


def mib(num_bytes: int | None) -> float | None:
    return None if num_bytes is None else num_bytes / 2**20


def memory_json() -> dict[str, float | None]:
    return {"peak_rss_mib": mib(peak_rss_bytes()), "peak_device_memory_mib": mib(peak_device_memory_bytes())}


def startup_seconds(first_token_perf: float | None, process_start: float) -> float | None:
    """Process start to the first generated token, the issue's start-up measure."""
    return None if first_token_perf is None else wall_time(first_token_perf) - process_start


# The vector extensions the CPU kernels can use, in the order they widen what a core does per cycle.
_VECTOR_ISA = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def cpu_json(cpuinfo: str = "/proc/cpuinfo") -> dict[str, str | None]:
    """The CPU's model name and the vector extensions it has (from ``/proc/cpuinfo``): machines
    differ from one run to the next, and kernels tuned on AVX-512 behave differently on AVX2 only."""
    model: str | None = None
    flags: set[str] = set()
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model is None:
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    isa = " ".join(name for name in _VECTOR_ISA if name in flags) or None
    return {"cpu_model": model, "cpu_isa": isa}


def cpu_kernels_json() -> dict[str, str | None]:
    """The instruction set the CPU platform's kernels were built for (``TOKENMILL_CPU_ISA``, by
    default the CPU's own), where this process loaded them; None elsewhere (a GPU platform, or
    engine workers in other processes). Read from the loaded module, never imported here: the
    bench does not depend on the CPU platform."""
    kernels: Any = sys.modules.get("tokenmill_platform_cpu.kernels")
    load: Any = getattr(kernels, "load_kernels", None)
    loaded = hasattr(load, "cache_info") and load.cache_info().currsize > 0 and load() is not None
    return {"cpu_kernel_isa": str(kernels.kernel_isa()) if loaded and hasattr(kernels, "kernel_isa") else None}
