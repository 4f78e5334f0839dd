"""Run by test_thread_binding.py in a child process, where the affinity mask may differ from the
test session's: narrows its mask as told, configures the CPU platform as an engine's process does
(threads from the mask and the cgroup quota, ``TOKENMILL_CPU_BIND`` from the environment), runs
kernels that split their work over the pool, and prints one JSON object: the pool's view of the
binding and the operating system's (``/proc/self/task/<tid>/status``), per thread.

    python thread_binding_probe.py [--mask 0,1] [--cgroup-root DIR] [--outputs FILE] [--fork-mask 0,1]

``--fork-mask``: afterwards fork; the child sets its mask to these cores, runs the kernels again on
the pool it starts, and its report is the ``child`` entry of the parent's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path


def core_list(text: str) -> set[int]:
    """``0-2,5`` as the kernel writes Cpus_allowed_list (and as --mask takes it)."""
    cores: set[int] = set()
    for item in text.strip().split(","):
        first, _, last = item.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


def allowed_cores(tid: int) -> list[int]:
    """The cores the OS lets thread ``tid`` of this process run on."""
    for line in Path(f"/proc/self/task/{tid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return sorted(core_list(line.partition(":")[2]))
    raise AssertionError(f"no Cpus_allowed_list for thread {tid}")


def run_kernels(kernels: object) -> list[object]:
    """Kernels big enough to split over the threads, on fixed inputs."""
    import torch

    from tokenmill_platform_cpu.layer_ops import CpuLayerOps

    torch.manual_seed(0)
    ops = CpuLayerOps(kernels, packed_budget=1 << 40)
    x, weight = torch.randn(300, 768), torch.randn(768)
    linear_weight = torch.randn(1000, 768)
    return [ops.rms_norm(x, weight, 1e-6), ops.silu_and_mul(torch.randn(97, 2 * 1536)),
            kernels.pack_linear_weight(linear_weight)]


def report(kernels: object) -> dict[str, object]:
    pool = dict(kernels.thread_pool_stats())
    pool["caller_allowed"] = allowed_cores(threading.get_native_id())
    pool["worker_allowed"] = [allowed_cores(tid) for tid in pool["worker_tids"]]
    pool["process_mask"] = sorted(os.sched_getaffinity(0))
    return pool


def forked_child_report(kernels: object, mask: set[int]) -> dict[str, object]:
    """Fork; the child narrows or widens its mask, starts its own pool, and reports through a pipe."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        status = 1
        try:
            import torch

            torch.set_num_threads(1)  # GNU OpenMP's team did not fork: torch's ops stay on this thread
            os.sched_setaffinity(0, mask)
            run_kernels(kernels)
            os.write(write_end, json.dumps(report(kernels)).encode())
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        text = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert status == 0 and text, f"the forked child failed (status {status})"
    return json.loads(text)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mask")
    parser.add_argument("--cgroup-root")
    parser.add_argument("--outputs")
    parser.add_argument("--fork-mask")
    args = parser.parse_args()
    if args.mask:
        os.sched_setaffinity(0, core_list(args.mask))  # before any thread starts, as a TP rank pins itself

    import torch

    from tokenmill.config import EngineConfig
    from tokenmill_platform_cpu.kernels import load_kernels
    from tokenmill_platform_cpu.platform import CpuPlatform

    platform = CpuPlatform()
    if args.cgroup_root:
        platform.cgroup_root = Path(args.cgroup_root)
    platform.configure_process(EngineConfig())
    kernels = load_kernels()
    outputs = run_kernels(kernels)
    result = report(kernels)
    if args.outputs:
        torch.save(outputs, args.outputs)
    if args.fork_mask:
        result["child"] = forked_child_report(kernels, core_list(args.fork_mask))
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
