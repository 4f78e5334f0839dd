"""Step graphs in the engine: decode steps replayed through a captured graph give what the
same steps give run eagerly (tests/test_golden.py checks them against transformers)."""

from __future__ import annotations

import random

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill_platform_cpu.kernels import kernels_available

pytestmark = pytest.mark.skipif(not kernels_available(), reason="no C++ compiler to build the CPU kernels")


def _prompts(count: int) -> list[dict]:
    rng = random.Random(7)
    return [{"prompt_token_ids": [rng.randrange(3, 380) for _ in range(rng.randrange(4, 40))]} for _ in range(count)]


def _sampled(llm: LLM, count: int) -> list[list[int]]:
    """Seeded sampling at temperature 1, requests stopping one after another."""
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=6 + 3 * i, ignore_eos=True) for i in range(count)]
    return [out.outputs[0].token_ids for out in llm.generate(_prompts(count), params)]


def _engine(path, **options) -> LLM:
    return LLM(str(path), dtype="float32", max_model_len=128, kv_cache_memory="32MiB", **options)


def test_sampling_through_graphs_matches_eager(llama_path):
    eager = _engine(llama_path, enforce_eager=True)
    assert eager.engine.core.executor.runner.graphs is None
    graphed = _engine(llama_path)
    assert _sampled(graphed, 5) == _sampled(eager, 5)
    assert graphed.engine.core.executor.runner.graphs.batch_sizes == [1, 2, 3, 4, 5]


def test_batches_past_the_limit_run_eagerly(llama_path):
    llm = _engine(llama_path, max_graph_batch_size=2)
    assert _sampled(llm, 4) == _sampled(_engine(llama_path, enforce_eager=True), 4)
    assert llm.engine.core.executor.runner.graphs.batch_sizes == [1, 2]
    assert _engine(llama_path, max_graph_batch_size=0).engine.core.executor.runner.graphs is None


def test_a_failed_capture_falls_back_to_eager(llama_path, monkeypatch):
    """Without packed weights, float32 matmuls of three or more rows go to torch, which a
    step graph cannot replay: those batch sizes run eagerly, the rest through graphs."""
    monkeypatch.setenv("TOKENMILL_PACKED_WEIGHTS", "0")
    llm = _engine(llama_path)
    assert _sampled(llm, 4) == _sampled(_engine(llama_path, enforce_eager=True), 4)
    graphs = llm.engine.core.executor.runner.graphs
    assert graphs.batch_sizes == [1, 2]
    assert graphs.eager_batch_sizes == [3, 4]
