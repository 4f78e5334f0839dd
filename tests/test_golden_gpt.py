"""Greedy output and logprobs of GPT-2 and GPT-NeoX (``models/gpt``) against transformers
``generate`` on the same weights, float32, a batch of 8 prompts of 5 to 60 tokens; also
with prompts prefilled in chunks of 16 tokens and with prefix-cache hits."""

from __future__ import annotations

import functools

import pytest
from gpt_models import GPT_ARCHS, build_gpt_model
from test_golden import _assert_matches, _generate, _greedy, _prompts
from tiny_models import hf_greedy
from worker_probe import attention_backend

from tokenmill import LLM

MAX_NEW = 12
ARCHS = sorted(GPT_ARCHS)


@pytest.fixture(scope="module")
def gpt_model(tmp_path_factory):
    return functools.cache(lambda arch: build_gpt_model(tmp_path_factory.mktemp(arch), arch))


@pytest.fixture(scope="module")
def gpt_reference(gpt_model):
    return functools.cache(lambda arch: hf_greedy(gpt_model(arch), _prompts(1), MAX_NEW))


@pytest.mark.parametrize("backend", ["sdpa", "cpu-paged"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(arch, backend, gpt_model, gpt_reference):
    llm, outputs = _generate(gpt_model(arch), attention_backend=backend)
    assert attention_backend(llm) == backend
    _assert_matches(outputs, gpt_reference(arch))


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_of_16_tokens(arch, gpt_model, gpt_reference):
    """Prompts prefilled 16 tokens a step: a chunk's learned (GPT-2) or rotated (GPT-NeoX)
    positions continue where the chunk before it stopped."""
    _, outputs = _generate(gpt_model(arch), max_num_batched_tokens=16)
    _assert_matches(outputs, gpt_reference(arch))


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_cache_hits_match_transformers(arch, gpt_model):
    path = gpt_model(arch)
    prompts = _prompts(2, count=6, shared_prefix=40)
    expected = hf_greedy(path, prompts, MAX_NEW)
    llm = LLM(str(path), dtype="float32", max_model_len=128, kv_cache_memory="32MiB", enable_prefix_caching=True)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], _greedy())
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], _greedy())
    _assert_matches(first + rest, expected)
    assert all(out.num_cached_tokens >= 32 for out in rest), [o.num_cached_tokens for o in rest]


@pytest.mark.parametrize("arch", ["gpt2", "gpt-neox"])
def test_two_tensor_parallel_ranks_match_transformers(arch, gpt_model, gpt_reference):
    """Heads, the MLP's columns and the vocabulary halved over two ranks (gloo on the CPU);
    the fused q/k/v cut into q, k and v before each is split by heads."""
    llm, outputs = _generate(gpt_model(arch), tensor_parallel_size=2)
    _assert_matches(outputs, gpt_reference(arch))
    llm.engine.shutdown()
