"""CPU binding: each "mp" rank pinned to its own cores, read back from the running workers."""

from __future__ import annotations

import os

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.executor.cpu_binding import rank_core_sets


@pytest.mark.parametrize(("cores", "world_size", "expected"), [
    ([0, 1], 2, [{0}, {1}]),
    ([0, 1, 2, 3, 4], 2, [{0, 1, 2}, {3, 4}]),
    ([2, 5, 7, 9], 4, [{2}, {5}, {7}, {9}]),
    ([0, 1], 4, [{0}, {1}, {0}, {1}]),  # fewer cores than ranks: spread, shared
    ([3], 2, [{3}, {3}]),
])
def test_cores_are_cut_into_contiguous_slices_one_per_rank(cores, world_size, expected):
    assert rank_core_sets(cores, world_size) == [frozenset(s) for s in expected]


@pytest.fixture(autouse=True)
def _keep_this_process_threads():
    """The engines below are asked for every core, which their platform sets in this process too."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _affinity_and_threads(worker: object) -> tuple[list[int], int]:
    import torch

    return sorted(os.sched_getaffinity(0)), torch.get_num_threads()


def _ranks(llm: LLM) -> list[tuple[list[int], int]]:
    return llm.engine.core.executor.collective_rpc(_affinity_and_threads)


def _two_ranks(path: object) -> LLM:
    # the engine's threads: every allowed core, so each rank's share is what its cores allow
    llm = LLM(str(path), dtype="float32", max_model_len=128, kv_cache_memory="16MiB", tensor_parallel_size=2,
              num_threads=len(os.sched_getaffinity(0)))
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=3))
    assert len(out[0].outputs[0].token_ids) == 3  # the pinned ranks still run their collectives
    return llm


def test_each_rank_runs_on_its_own_cores_with_one_thread_per_core(llama_path):
    allowed = sorted(os.sched_getaffinity(0))
    llm = _two_ranks(llama_path)
    try:
        ranks = _ranks(llm)
    finally:
        llm.engine.shutdown()
    cores = [set(c) for c, _ in ranks]
    assert all(c and c <= set(allowed) for c in cores)
    if len(allowed) >= 2:  # one core each at least: disjoint, and together every allowed core
        assert not cores[0] & cores[1] and cores[0] | cores[1] == set(allowed)
    else:
        assert cores[0] == cores[1] == set(allowed)
    assert [threads for _, threads in ranks] == [max(1, min(len(allowed) // 2, len(c))) for c in cores]


def test_binding_turned_off_leaves_every_rank_the_engines_cores(llama_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CPU_BINDING", "0")
    llm = _two_ranks(llama_path)
    try:
        ranks = _ranks(llm)
    finally:
        llm.engine.shutdown()
    allowed = sorted(os.sched_getaffinity(0))
    assert [c for c, _ in ranks] == [allowed, allowed]
    assert [threads for _, threads in ranks] == [max(1, len(allowed) // 2)] * 2
