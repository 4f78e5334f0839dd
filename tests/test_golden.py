"""Greedy output and logprobs against transformers ``generate`` on the same weights."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tiny_models import hf_greedy
from worker_probe import attention_backend, graph_batch_sizes

from tokenmill import LLM, SamplingParams

MAX_NEW = 12
ARCHS = ["llama", "llama-tied-llama3rope", "llama-yarn", "llama-linear-rope", "llama-dynamic-rope",
         "mistral", "qwen2", "qwen3"]


def _prompts(seed: int, count: int = 8, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 380) for _ in range(shared_prefix)]
    lengths = [5, 9, 17, 23, 31, 40, 47, 60][:count]
    return [prefix + [rng.randrange(3, 380) for _ in range(n)] for n in lengths]


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)


def _assert_matches(outputs, expected) -> None:
    for i, (out, (tokens, logprobs)) in enumerate(zip(outputs, expected, strict=True)):
        completion = out.outputs[0]
        assert completion.token_ids == tokens, f"prompt {i}: greedy tokens differ from transformers"
        ours = [next(iter(step.values())).logprob for step in completion.logprobs]
        assert ours == pytest.approx(logprobs, abs=1e-3), f"prompt {i}: logprobs differ"


def _generate(path: Path, **options):
    """An engine on ``path`` (float32) and its greedy outputs of the prompts of seed 1 (for the
    other families' golden tests)."""
    llm = LLM(str(path), dtype="float32", max_model_len=128, kv_cache_memory="32MiB", **options)
    return llm, llm.generate([{"prompt_token_ids": p} for p in _prompts(1)], _greedy())


@pytest.fixture(scope="module")
def reference(model_factory):
    cache = {}

    def get(arch: str, prompts_key: tuple) -> list:
        if (arch, prompts_key) not in cache:
            cache[(arch, prompts_key)] = hf_greedy(model_factory(arch), _prompts(*prompts_key), MAX_NEW)
        return cache[(arch, prompts_key)]

    return get


@pytest.mark.parametrize("backend", ["sdpa", "cpu-paged"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(arch, backend, model_factory, reference):
    llm = LLM(str(model_factory(arch)), dtype="float32", max_model_len=128, kv_cache_memory="32MiB",
              attention_backend=backend)
    assert attention_backend(llm) == backend
    prompts = _prompts(1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy())
    _assert_matches(outputs, reference(arch, (1,)))
    # the CPU kernels' decode steps ran as a step graph (captured once, then replayed); SDPA's never do
    assert (graph_batch_sizes(llm) or []) == ([8] if backend == "cpu-paged" else [])


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_chunked_prefill_of_16_tokens(arch, model_factory, reference):
    llm = LLM(str(model_factory(arch)), dtype="float32", max_model_len=128, kv_cache_memory="32MiB",
              max_num_batched_tokens=16)
    outputs = llm.generate([{"prompt_token_ids": p} for p in _prompts(1)], _greedy())
    _assert_matches(outputs, reference(arch, (1,)))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prefix_caching_hits_and_matches(arch, model_factory, reference):
    llm = LLM(str(model_factory(arch)), dtype="float32", max_model_len=128, kv_cache_memory="32MiB",
              enable_prefix_caching=True)
    prompts = _prompts(2, count=6, shared_prefix=40)
    expected = reference(arch, (2, 6, 40))
    first = llm.generate([{"prompt_token_ids": prompts[0]}], _greedy())
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], _greedy())
    _assert_matches(first + rest, expected)
    assert all(out.num_cached_tokens >= 32 for out in rest), [o.num_cached_tokens for o in rest]
    assert llm.engine.scheduler_stats.prefix_cache_hits >= 32 * len(rest)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_preemption_recomputes_exactly(arch, model_factory, reference):
    # 10 blocks of 16 tokens: 8 prompts of up to 72 tokens cannot all stay resident.
    llm = LLM(str(model_factory(arch)), dtype="float32", max_model_len=128, num_kv_blocks=10)
    outputs = llm.generate([{"prompt_token_ids": p} for p in _prompts(1)], _greedy())
    assert llm.engine.scheduler_stats.num_preemptions > 0
    _assert_matches(outputs, reference(arch, (1,)))
    assert llm.engine.scheduler_stats.kv_blocks_free == 10


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_step_graphs_match_at_every_batch_size(arch, model_factory, reference):
    """Requests that stop one after another leave decode batches of 8, 6, 4, 2 and 1, each
    for at least two steps: every size is captured as a step graph on its first decode step
    and replayed on the next ones, and the tokens stay transformers'."""
    llm = LLM(str(model_factory(arch)), dtype="float32", max_model_len=128, kv_cache_memory="32MiB",
              attention_backend="cpu-paged")
    max_tokens = [4, 4, 6, 6, 8, 8, 10, 12]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0) for n in max_tokens]
    outputs = llm.generate([{"prompt_token_ids": p} for p in _prompts(1)], params)
    expected = [(tokens[:n], logprobs[:n]) for (tokens, logprobs), n in zip(reference(arch, (1,)), max_tokens,
                                                                         strict=True)]
    _assert_matches(outputs, expected)
    assert graph_batch_sizes(llm) == [1, 2, 4, 6, 8]
