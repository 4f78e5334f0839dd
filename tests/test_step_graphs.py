"""Step graphs in the engine: decode steps replayed through a captured graph give what the
same steps give run eagerly (tests/test_golden.py checks them against transformers)."""

from __future__ import annotations

import random

import pytest
import torch
from worker_probe import runner

from tokenmill import LLM, SamplingParams
from tokenmill.worker.step_graphs import KernelProfile
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


def _runner(llm: LLM):
    return runner(llm)


def test_sampling_through_graphs_matches_eager(llama_path):
    eager = _engine(llama_path, enforce_eager=True)
    assert _runner(eager).graphs is None
    graphed = _engine(llama_path)
    assert _sampled(graphed, 5) == _sampled(eager, 5)
    assert _runner(graphed).graphs.batch_sizes == [1, 2, 3, 4, 5]


def test_batches_past_the_limit_run_eagerly(llama_path):
    llm = _engine(llama_path, max_graph_batch_size=2)
    assert _sampled(llm, 4) == _sampled(_engine(llama_path, enforce_eager=True), 4)
    assert _runner(llm).graphs.batch_sizes == [1, 2]
    assert _runner(_engine(llama_path, max_graph_batch_size=0)).graphs is None


def test_unpacked_weights_are_replayed_through_torch_linear(llama_path, monkeypatch):
    """Without packed weights, float32 matmuls of three or more rows go to torch's linear,
    which the capture records as a graph op: every batch size still gets a graph."""
    monkeypatch.setenv("TOKENMILL_PACKED_WEIGHTS", "0")
    llm = _engine(llama_path)
    assert _sampled(llm, 4) == _sampled(_engine(llama_path, enforce_eager=True), 4)
    graphs = _runner(llm).graphs
    assert graphs.batch_sizes == [1, 2, 3, 4] and graphs.eager_batch_sizes == []


def test_a_failed_capture_falls_back_to_eager(fault_model_path):
    """The fault-injection model looks for its poison tokens with torch calls in its
    forward, which a step graph cannot replay: every decode batch runs eagerly."""
    llm = _engine(fault_model_path)
    assert _sampled(llm, 3) == _sampled(_engine(fault_model_path, enforce_eager=True), 3)
    graphs = _runner(llm).graphs
    assert graphs.batch_sizes == [] and graphs.eager_batch_sizes == [1, 2, 3]


def test_the_lm_head_runs_inside_the_graph(llama_path):
    llm = _engine(llama_path)
    assert _sampled(llm, 3) == _sampled(_engine(llama_path, enforce_eager=True), 3)
    graphs = _runner(llm).graphs
    assert graphs.batch_sizes == graphs.lm_head_batch_sizes == [1, 2, 3]


def _soft_capped(model, cap: float = 3.0) -> None:
    """Logit soft-capping (Gemma 2's ``cap * tanh(logits / cap)``), computed in torch
    after the lm_head: a compute_logits a step graph cannot take."""
    lm_head = model.compute_logits
    model.compute_logits = lambda hidden: torch.tanh(lm_head(hidden) / cap) * cap


def test_an_lm_head_the_graph_cannot_take_runs_after_it(llama_path):
    """The layers are still replayed; the logits are computed from the graph's hidden states."""
    llm, eager = _engine(llama_path), _engine(llama_path, enforce_eager=True)
    for engine in (llm, eager):
        _soft_capped(_runner(engine).model)
    assert _sampled(llm, 3) == _sampled(eager, 3) != _sampled(_engine(llama_path), 3)
    graphs = _runner(llm).graphs
    assert graphs.batch_sizes == [1, 2, 3] and graphs.eager_batch_sizes == graphs.lm_head_batch_sizes == []


def test_a_kernel_profile_times_every_replayed_kernel(llama_path):
    llm = _engine(llama_path)
    graphs = _runner(llm).graphs
    graphs.kernel_profile = profile = KernelProfile()
    profiled = _sampled(llm, 2)
    graphs.kernel_profile = None
    assert profiled == _sampled(_engine(llama_path, enforce_eager=True), 2)  # profiled replays are replays
    # 6 and 9 tokens, the first from the prompt step: 5 decode steps of 2 requests, then 3 of
    # one; the first step of each batch size is its capture, the others replays
    assert profile.steps == (5 - 1) + (3 - 1)
    layers = _runner(llm).model.config.num_hidden_layers
    assert profile.calls["paged_attention"] == layers * profile.steps
    assert profile.calls["small_linear"] == (4 * layers + 1) * profile.steps  # qkv, o, gate_up, down; lm_head
    assert all(seconds > 0 for seconds in profile.seconds.values())
