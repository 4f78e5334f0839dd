"""The CPU platform's shared-memory communicator, in two real processes joined over gloo
(shm_ranks.py): every collective equals torch's on the ranks' tensors for odd sizes and
several dtypes, hundreds in a row; a tensor larger than a slot goes over gloo; with
``TOKENMILL_CPU_SHM_COMM=0`` the group is gloo's alone; a rank that exits while its peer waits
fails the peer's collective instead of hanging it; no segment stays in /dev/shm."""

from __future__ import annotations

import multiprocessing
import queue

import pytest
import shm_ranks

from tokenmill.executor.multiproc import free_port
from tokenmill_platform_cpu.shm_communicator import shm_enabled

pytestmark = pytest.mark.skipif(not shm_enabled(), reason="no /dev/shm, or a CPU whose stores may be reordered")

SMALL_SLOTS = {"TOKENMILL_CPU_SHM_COMM_BYTES": "4KiB"}  # the 2000-element tensors do not fit


def _run(scenario: str, env: dict[str, str], expect: int = 2, timeout: float = 120) -> list[dict]:
    context = multiprocessing.get_context("spawn")
    answers = context.Queue()
    port = free_port()
    ranks = [context.Process(target=shm_ranks.run_rank, args=(rank, port, scenario, env, answers), daemon=True)
             for rank in range(shm_ranks.WORLD)]
    for rank in ranks:
        rank.start()
    try:
        replies = [answers.get(timeout=timeout) for _ in range(expect)]
    except queue.Empty:
        pytest.fail(f"{scenario}: a rank did not answer within {timeout} s (a hang)")
    finally:
        for rank in ranks:
            rank.join(10)
            if rank.is_alive():
                rank.kill()
    errors = [value for status, value in replies if status == "error"]
    assert not errors, errors[0]
    return [value for _, value in replies]


def test_collectives_equal_torch_and_large_tensors_take_gloo():
    before = shm_ranks.segment_files()
    for facts in _run("collectives", SMALL_SLOTS):
        assert facts["type"] == "ShmCommunicator"
        assert facts["through_segment"] > 0 and facts["over_gloo"] > 0  # the 2000-element ones
        assert facts["counted"] == 8 * len(shm_ranks.SHAPES) * len(shm_ranks.DTYPES) * 4  # both paths are timed
        assert facts["segment_files_left"] == []  # unlinked once both ranks mapped it
    assert shm_ranks.segment_files() <= before


def test_disabled_is_gloo_alone():
    for facts in _run("collectives", {"TOKENMILL_CPU_SHM_COMM": "0"}):
        assert facts["type"] == "Communicator" and facts["counted"] > 0


def test_a_peer_that_exits_fails_the_waiting_collective():
    (facts,) = _run("peer_exits", {}, expect=1)
    assert "rank 1" in facts["error"] and "exited during a collective" in facts["error"]
