"""Engine statistics and the Prometheus logger after a known workload."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tokenmill import EngineConfig, SamplingParams
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.metrics.logging_logger import LoggingStatLogger
from tokenmill.metrics.prometheus import PrometheusStatLogger


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture()
def engine_and_registry(llama_path):
    registry = CollectorRegistry()
    engine = LLMEngine(EngineConfig(model=str(llama_path), max_model_len=128, kv_cache_memory="16MiB"),
                       stat_loggers=[PrometheusStatLogger("tiny", registry), LoggingStatLogger(interval_s=0.0)])
    return engine, registry


def _run(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def test_counts_after_a_known_workload(engine_and_registry, caplog):
    engine, registry = engine_and_registry
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13] * 20]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=6, ignore_eos=True))
    engine.add_request("aborted", {"prompt_token_ids": [3, 4]}, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.abort_request("aborted")
    with caplog.at_level(logging.INFO, logger="tokenmill.metrics"):
        _run(engine)
    s = _samples(registry)
    assert s[("tokenmill:request_success_total", (("finished_reason", "length"),))] == 3
    assert s[("tokenmill:request_success_total", (("finished_reason", "abort"),))] == 1
    assert s[("tokenmill:num_aborted_requests_total", ())] == 1
    assert s[("tokenmill:generation_tokens_total", ())] == 3 * 6 + 1
    assert s[("tokenmill:prompt_tokens_total", ())] == sum(map(len, prompts)) + 2
    assert s[("tokenmill:time_to_first_token_seconds_count", ())] == 4
    assert s[("tokenmill:inter_token_latency_seconds_count", ())] == 3 * 5
    assert s[("tokenmill:e2e_request_latency_seconds_count", ())] == 4
    assert s[("tokenmill:request_generation_tokens_sum", ())] == 3 * 6 + 1
    assert s[("tokenmill:num_requests_running", ())] == 0
    assert s[("tokenmill:kv_cache_usage_perc", ())] == 0
    assert s[("tokenmill:spec_decode_num_draft_tokens_total", ())] == 0
    assert any("generation throughput" in r.getMessage() for r in caplog.records)


def test_prefix_cache_and_preemption_counters(llama_path):
    registry = CollectorRegistry()
    engine = LLMEngine(EngineConfig(model=str(llama_path), max_model_len=64, num_kv_blocks=5),
                       stat_loggers=[PrometheusStatLogger("tiny", registry)])
    shared = list(range(3, 40))
    engine.add_request("a", {"prompt_token_ids": shared}, SamplingParams(max_tokens=1))
    _run(engine)
    engine.add_request("b", {"prompt_token_ids": shared}, SamplingParams(max_tokens=1))
    _run(engine)
    s = _samples(registry)
    assert s[("tokenmill:prefix_cache_hits_total", ())] == 32
    assert s[("tokenmill:prefix_cache_queries_total", ())] == 2 * len(shared)
    for i in range(3):
        engine.add_request(f"p{i}", {"prompt_token_ids": [50 + i] * 20}, SamplingParams(max_tokens=30,
                                                                                       ignore_eos=True))
    _run(engine)
    assert _samples(registry)[("tokenmill:num_preemptions_total", ())] == engine.scheduler_stats.num_preemptions > 0
