"""MoE decode steps in step graphs: with the CPU platform's routed MoE kernel (softmax top-k
routing, the expert-load count and the experts in one recorded call) every decode batch size of
a softmax-routed MoE model is captured, and the replayed steps give the tokens, logprobs and
expert load of the same steps run eagerly (tests/test_moe_golden.py checks them against
transformers, graphs on)."""

from __future__ import annotations

import random

import pytest
from moe_models import build_moe_model
from worker_probe import on_rank_zero, runner

from tokenmill import LLM, SamplingParams
from tokenmill.layers.moe import expert_load_by_layer
from tokenmill_platform_cpu.kernels import kernels_available

pytestmark = pytest.mark.skipif(not kernels_available(), reason="no C++ compiler to build the CPU kernels")


def _prompts() -> list[dict]:
    rng = random.Random(5)
    return [{"prompt_token_ids": [rng.randrange(3, 380) for _ in range(n)]} for n in (5, 12, 20, 33)]


def _run(llm: LLM) -> tuple[list, dict]:
    # requests finishing one after another: decode batches of 4, 3, 2 and 1
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 2 * i, ignore_eos=True, logprobs=0) for i in range(4)]
    outputs = llm.generate(_prompts(), params)
    tokens = [(out.outputs[0].token_ids, [next(iter(lp.values())).logprob for lp in out.outputs[0].logprobs])
              for out in outputs]
    return tokens, on_rank_zero(llm, lambda worker: expert_load_by_layer(worker.runner.model))


@pytest.mark.parametrize("arch", ["mixtral", "qwen3-moe"])  # top-2 renormalised / every second layer MoE
def test_moe_decode_steps_are_captured_and_match_eager(arch, tmp_path):
    path = build_moe_model(tmp_path, arch)
    options = dict(dtype="float32", max_model_len=64, kv_cache_memory="16MiB")
    graphed = LLM(str(path), **options)
    (tokens, load) = _run(graphed)
    graphs = runner(graphed).graphs
    assert graphs.batch_sizes == [1, 2, 3, 4] and graphs.eager_batch_sizes == []
    eager_tokens, eager_load = _run(LLM(str(path), enforce_eager=True, **options))
    assert [t for t, _ in tokens] == [t for t, _ in eager_tokens]
    for (_, logprobs), (_, eager_logprobs) in zip(tokens, eager_tokens, strict=True):
        assert logprobs == pytest.approx(eager_logprobs, abs=1e-4)
    assert load == eager_load
