"""The ranks of test_shm_communicator: each a spawned process that joins a gloo group, builds
the CPU platform's communicator and runs one scenario, answering ``("ok", facts)`` or
``("error", traceback)`` on its queue."""

from __future__ import annotations

import os
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

WORLD = 2
SHAPES = [(1,), (7,), (3, 5, 7), (1023,), (2000,)]  # odd sizes; with 4 KiB slots the last falls back to gloo
DTYPES = [torch.float32, torch.bfloat16, torch.int64]


def rank_tensor(rank: int, call: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """What ``rank`` contributes to collective ``call``: any rank can make any rank's."""
    generator = torch.Generator().manual_seed(1000 * call + rank)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=generator, dtype=dtype)


def run_rank(rank: int, port: int, scenario: str, env: dict[str, str], answers: Any) -> None:
    try:
        os.environ.update(env)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
        from tokenmill_platform_cpu.platform import CpuPlatform

        comm = CpuPlatform().create_communicator(rank, WORLD, None)
        answers.put(("ok", SCENARIOS[scenario](comm, rank)))
    except BaseException:
        answers.put(("error", traceback.format_exc()))


def collectives(comm: Any, rank: int) -> dict[str, Any]:
    """Rounds of every collective over every shape and dtype, each checked against torch on
    the ranks' tensors made here; 600 collectives in a row."""
    from tokenmill_platform_cpu.shm_communicator import NAME_PREFIX, SHM_DIR

    call = 0
    for _ in range(8):
        for shape in SHAPES:
            for dtype in DTYPES:
                call += 1
                parts = [rank_tensor(r, call, shape, dtype) for r in range(WORLD)]
                total = comm.all_reduce(parts[rank].clone())
                assert torch.equal(total, torch.add(parts[0], parts[1])), (shape, dtype)
                dim = len(shape) - 1
                assert torch.equal(comm.all_gather(parts[rank], dim=dim), torch.cat(parts, dim=dim))
                gathered = comm.gather(parts[rank], dst=1, dim=0)
                assert torch.equal(gathered, torch.cat(parts, dim=0) if rank == 1 else parts[rank])
                mine = parts[rank].clone()
                assert torch.equal(comm.broadcast(mine, src=1), parts[1])
    pids = getattr(comm, "pids", [])  # rank 0 unlinked the segment's file before its first collective
    leftover = [p.name for p in SHM_DIR.glob(f"{NAME_PREFIX}*") if pids and p.name.startswith(f"{NAME_PREFIX}{pids[0]}-")]
    return {"type": type(comm).__name__, "through_segment": getattr(comm, "calls", 0),
            "over_gloo": getattr(comm, "fallbacks", 0), "segment_files_left": leftover,
            "counted": comm.time.calls}


def peer_exits(comm: Any, rank: int) -> dict[str, Any]:
    """Rank 1 exits instead of joining the second all-reduce; rank 0 must not wait forever."""
    comm.all_reduce(torch.ones(4))
    if rank == 1:
        os._exit(3)
    try:
        comm.all_reduce(torch.ones(4))
    except RuntimeError as error:
        return {"error": str(error)}
    return {"error": None}


SCENARIOS = {"collectives": collectives, "peer_exits": peer_exits}


def segment_files() -> set[str]:
    from tokenmill_platform_cpu.shm_communicator import NAME_PREFIX, SHM_DIR

    return {p.name for p in Path(SHM_DIR).glob(f"{NAME_PREFIX}*")}
