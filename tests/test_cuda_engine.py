"""The engine on a CUDA GPU against transformers on the CPU (float32 ground
truth). Run by scripts/gpu-check; skipped where torch sees no CUDA device.

The KV cache is given an explicit small budget so that many engines in one
process do not each claim most of the card."""

from __future__ import annotations

import pytest
import torch
from test_golden import ARCHS, _assert_matches, _greedy, _prompts, reference  # noqa: F401  (fixture)
from worker_probe import on_rank_zero

from tokenmill import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

KV = "64MiB"


def _kv_cache_device(worker) -> str:
    return worker.runner.kv_caches[0][0].device.type


def _cuda_llm(path, **overrides) -> LLM:
    options = {"dtype": "float32", "max_model_len": 128, "kv_cache_memory": KV} | overrides
    llm = LLM(str(path), **options)
    assert llm.engine.model_info.device_type == "cuda"
    return llm


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_on_cuda_matches_transformers(arch, model_factory, reference):  # noqa: F811
    llm = _cuda_llm(model_factory(arch))
    assert on_rank_zero(llm, _kv_cache_device) == "cuda"
    outputs = llm.generate([{"prompt_token_ids": p} for p in _prompts(1)], _greedy())
    _assert_matches(outputs, reference(arch, (1,)))


def test_chunked_prefill_prefix_caching_and_preemption_on_cuda(model_factory, reference):  # noqa: F811
    path = model_factory("llama")
    chunked = _cuda_llm(path, max_num_batched_tokens=16, enable_prefix_caching=True)
    prompts = _prompts(2, count=6, shared_prefix=40)
    first = chunked.generate([{"prompt_token_ids": prompts[0]}], _greedy())
    rest = chunked.generate([{"prompt_token_ids": p} for p in prompts[1:]], _greedy())
    _assert_matches(first + rest, reference("llama", (2, 6, 40)))
    assert all(out.num_cached_tokens >= 32 for out in rest)

    tight = _cuda_llm(path, num_kv_blocks=10)
    outputs = tight.generate([{"prompt_token_ids": p} for p in _prompts(1)], _greedy())
    assert tight.engine.scheduler_stats.num_preemptions > 0
    _assert_matches(outputs, reference("llama", (1,)))
    assert tight.engine.scheduler_stats.kv_blocks_free == 10


def test_seeded_sampling_on_cuda_ignores_the_batch(llama_path):
    llm = _cuda_llm(llama_path)
    prompt = {"prompt_token_ids": [5, 17, 33, 8, 91, 120, 7]}
    crowd = [{"prompt_token_ids": [9 + i, 40, 41, 42]} for i in range(5)]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    unseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    alone = llm.generate(prompt, seeded)[0].outputs[0].token_ids
    together = llm.generate([*crowd, prompt], [unseeded] * 5 + [seeded])[-1].outputs[0].token_ids
    assert alone == together


def test_bfloat16_default_stays_close_to_float32(llama_path):
    """bf16 is the CUDA default; teacher-forced prompt logprobs stay near float32's."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    prompt = {"prompt_token_ids": _prompts(3, count=8)[-1]}
    bf16 = LLM(str(llama_path), max_model_len=128, kv_cache_memory=KV)
    assert bf16.engine.model_info.dtype == "bfloat16"
    f32 = _cuda_llm(llama_path)
    low, high = (llm.generate(prompt, params)[0].prompt_logprobs[1:] for llm in (bf16, f32))
    ids = prompt["prompt_token_ids"][1:]
    diffs = [abs(a[t].logprob - b[t].logprob) for a, b, t in zip(low, high, ids, strict=True)]
    assert sum(diffs) / len(diffs) < 0.1, diffs  # ~0.02 measured; a broken path is off by nats


def test_kv_cache_sized_from_free_device_memory(llama_path):
    llm = LLM(str(llama_path), max_model_len=128, gpu_memory_utilization=0.2)
    assert on_rank_zero(llm, _kv_cache_device) == "cuda"
    total = torch.cuda.get_device_properties(0).total_memory
    used = llm.engine.model_info.num_kv_blocks * on_rank_zero(llm, "kv_bytes_per_block")
    assert 0 < used <= 0.2 * total
