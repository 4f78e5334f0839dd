"""The CUDA platform; the engine tests run only where a CUDA GPU is (scripts/gpu-check)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.plugins import get_plugin_manager

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_detection_matches_torch():
    manager = get_plugin_manager()
    found = {r.value.name for r in manager.collect("tokenmill_detect_platform")}
    assert ("cuda" in found) == (torch.cuda.is_available() and torch.version.hip is None)
    assert "cpu" in found


@pytest.mark.gpu
@gpu
def test_engine_on_cuda_matches_transformers_greedy(llama_path):
    from tiny_models import hf_greedy

    from tokenmill import LLM, SamplingParams

    llm = LLM(str(llama_path), dtype="float32", max_model_len=128, gpu_memory_utilization=0.3)
    assert llm.engine.core.platform.name == "cuda"
    prompts = [[5, 17, 33, 8, 91], [120, 7, 7, 300, 41, 2, 99, 14, 250] * 3]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outputs] == [t for t, _ in hf_greedy(llama_path, prompts, 12)]


@pytest.mark.gpu
@gpu
def test_kv_cache_sized_from_free_device_memory(llama_path):
    from tokenmill import LLM

    llm = LLM(str(llama_path), max_model_len=128, gpu_memory_utilization=0.2)
    cache = llm.engine.core.executor.runner.kv_caches[0][0]
    assert cache.device.type == "cuda"
    total = torch.cuda.get_device_properties(0).total_memory
    used = llm.engine.core.num_kv_blocks * llm.engine.core.executor.kv_bytes_per_block()
    assert 0 < used <= 0.2 * total
