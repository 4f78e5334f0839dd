"""Expert load as metrics: the Prometheus series a server exports and the keys
``tokenmill bench throughput`` reports, both read from the MoE layers' device counters.

Every MoE layer routes each computed token to top-k experts, so a layer's counts add
up to ``k`` times the tokens computed: prompts (less prefix-cache hits) plus all but the
last sampled token of each request (the last one is never fed back)."""

from __future__ import annotations

import json
import random

import pytest
from moe_models import build_moe_model
from prometheus_client import CollectorRegistry
from typer.testing import CliRunner

from tokenmill import LLM, SamplingParams
from tokenmill.metrics.expert_load import ExpertLoadStatLogger, engine_expert_loads

MAX_NEW = 6
TOP_K = 2


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    return build_moe_model(tmp_path_factory.mktemp("qwen2-moe"), "qwen2-moe")


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 380) for _ in range(n)] for n in (4, 11, 19, 30)]


def _samples(registry: CollectorRegistry, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {tuple(sorted(s.labels.items())): s.value for metric in registry.collect() for s in metric.samples
            if s.name == name}


def test_prometheus_series_count_every_routed_token(qwen2_moe):
    llm = LLM(str(qwen2_moe), dtype="float32", max_model_len=64, kv_cache_memory="8MiB")
    registry = CollectorRegistry()
    llm.engine.stat_loggers.append(ExpertLoadStatLogger(lambda: engine_expert_loads(llm.engine), "tiny", registry,
                                                        interval_s=0.0))
    llm.generate([{"prompt_token_ids": p} for p in _prompts()],
                 SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    tokens = _samples(registry, "tokenmill:moe_expert_tokens_total")
    computed = sum(len(p) for p in _prompts()) + len(_prompts()) * (MAX_NEW - 1)
    layers = {"model.layers.0.mlp.experts", "model.layers.2.mlp.experts"}  # layer 1 is dense
    for layer in layers:
        per_expert = {dict(k)["expert"]: v for k, v in tokens.items() if dict(k)["layer"] == layer}
        assert sum(per_expert.values()) == TOP_K * computed, layer
        assert set(per_expert) <= {str(e) for e in range(8)}
    assert {dict(k)["layer"] for k in tokens} == layers
    imbalance = _samples(registry, "tokenmill:moe_expert_load_imbalance")
    assert {dict(k)["layer"] for k in imbalance} == layers
    assert all(1.0 <= value <= 8.0 for value in imbalance.values())


def test_a_dense_model_reads_its_experts_once_and_exports_none(model_factory):
    llm = LLM(str(model_factory("llama")), dtype="float32", max_model_len=64, kv_cache_memory="8MiB")
    reads = []

    def read():
        reads.append(engine_expert_loads(llm.engine))
        return reads[-1]

    registry = CollectorRegistry()
    llm.engine.stat_loggers.append(ExpertLoadStatLogger(read, "tiny", registry, interval_s=0.0))
    llm.generate([{"prompt_token_ids": p} for p in _prompts()], SamplingParams(max_tokens=3, ignore_eos=True))
    assert reads == [{}]
    assert not _samples(registry, "tokenmill:moe_expert_tokens_total")


def test_bench_throughput_reports_the_expert_load_of_its_run(qwen2_moe, tmp_path):
    from tokenmill_cli.main import app

    out = tmp_path / "throughput.json"
    result = CliRunner().invoke(app, [
        "bench", "throughput", "--model", str(qwen2_moe), "--num-prompts", "5", "--random-input-len", "12",
        "--random-output-len", "4", "--seed", "3", "--kv-cache-memory", "8MiB", "--disable-tqdm",
        "--peak-gflops", "100", "--output-json", str(out)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert "Expert load max/mean (worst layer)" in result.output
    r = json.loads(out.read_text())
    assert r["moe_num_layers"] == 2 and r["num_preemptions"] == 0
    # the warm-up request ran before the first read: only the run's tokens count
    computed = r["total_input_tokens"] - r["prefix_cache_hits"] + r["total_output_tokens"] - r["completed"]
    for layer, load in r["moe_expert_load"].items():
        assert sum(load["tokens_per_expert"]) == TOP_K * computed, layer
        assert 1.0 <= load["max_mean_ratio"] <= 8.0
    ratios = [load["max_mean_ratio"] for load in r["moe_expert_load"].values()]
    assert r["moe_load_imbalance_max"] == max(ratios)
    assert r["moe_load_imbalance_mean"] == pytest.approx(sum(ratios) / len(ratios))
