"""The time each rank spends in its tensor-parallel collectives, read back through collective_rpc."""

from __future__ import annotations

import json

from worker_probe import communicator_kinds

from tokenmill import LLM, SamplingParams


def _generate(llm: LLM) -> None:
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}] * 3, SamplingParams(temperature=0.0, max_tokens=6,
                                                                          ignore_eos=True))


def test_both_ranks_count_the_same_collectives_inside_their_steps(llama_path):
    llm = LLM(str(llama_path), dtype="float32", max_model_len=128, kv_cache_memory="16MiB", tensor_parallel_size=2)
    try:
        before = llm.engine.core.executor.collective_rpc("communication_stats")
        _generate(llm)
        after = llm.engine.core.executor.collective_rpc("communication_stats")
        kinds = communicator_kinds(llm)
    finally:
        llm.engine.shutdown()
    runs = [{key: a[key] - b[key] for key in a} for a, b in zip(after, before, strict=True)]
    assert kinds == ["ShmCommunicator"] * 2  # the CPU platform's own: both ranks are on this machine
    # every layer all-reduces after its attention and after its MLP
    layers = json.loads((llama_path / "config.json").read_text())["num_hidden_layers"]
    for run in runs:
        assert run["steps"] >= 6
        assert run["comm_calls"] >= run["steps"] * (1 + 2 * layers)  # and the embedding's, and the lm_head's gather
        assert 0 < run["comm_seconds"] < run["step_seconds"]
    # a collective is one call on every rank of the group: the counts agree exactly
    assert runs[0]["comm_calls"] == runs[1]["comm_calls"] and runs[0]["steps"] == runs[1]["steps"]


def test_one_rank_runs_no_collective(llama_path):
    llm = LLM(str(llama_path), dtype="float32", max_model_len=128, kv_cache_memory="16MiB")
    _generate(llm)
    (stats,) = llm.engine.core.executor.collective_rpc("communication_stats")
    assert stats["comm_calls"] == 0 and stats["comm_seconds"] == 0 and stats["steps"] >= 6
