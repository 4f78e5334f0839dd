"""The largest-step profile a device platform measures before sizing its KV cache
(tokenmill.worker.memory_profile), run here on the CPU runner: it runs through the real model
and backend, leaves the runner's own KV cache bound, and the engine still matches transformers."""

from __future__ import annotations

import torch
from test_golden import _assert_matches, _greedy, _prompts, reference  # noqa: F401  (fixture)
from worker_probe import runner

from tokenmill import LLM
from tokenmill.worker.memory_profile import profile_forward, profile_metadata


def test_profile_metadata_is_one_prefill_over_consecutive_blocks():
    metadata = profile_metadata(37, 16, torch.device("cpu"))
    assert metadata.block_table.tolist() == [[0, 1, 2]] and metadata.slot_mapping.tolist() == list(range(37))
    assert metadata.query_start_loc.tolist() == [0, 37] and metadata.seq_lens.tolist() == [37]


def test_profiling_the_largest_step_leaves_the_engine_as_it_was(model_factory, reference):  # noqa: F811
    llm = LLM(str(model_factory("llama")), dtype="float32", max_model_len=128, kv_cache_memory="32MiB",
              max_num_batched_tokens=96)
    model_runner = runner(llm)
    caches = [layer.kv_cache for layer in model_runner.attention_layers]
    profile_forward(model_runner, 96)()
    assert all(layer.kv_cache is cache for layer, cache in zip(model_runner.attention_layers, caches, strict=True))
    outputs = llm.generate([{"prompt_token_ids": p} for p in _prompts(1)], _greedy())
    _assert_matches(outputs, reference("llama", (1,)))
