"""The largest-step profile a device platform measures before sizing its KV cache
(tokenmill.worker.memory_profile), run here on the CPU runner: it runs through the real model
and backend, leaves the runner's own KV cache bound, and the engine still matches transformers."""

from __future__ import annotations

import torch
from test_golden import _assert_matches, _greedy, _prompts, reference  # noqa: F401  (fixture)
from worker_probe import runner

from tokenmill import LLM
from tokenmill.worker.memory_profile import profile_forward, profile_lengths, profile_metadata


def test_the_largest_step_is_split_into_prompts_the_model_serves():
    assert profile_lengths(300, 128, 8) == [128, 128, 44]
    assert profile_lengths(300, 128, 2) == [128, 128]  # no more requests than the batch holds


def test_profile_metadata_lays_each_prompt_in_its_own_blocks():
    """The reference backend over the profile's metadata equals attention over each prompt alone."""
    from paged_attention_cases import PagedCase, sdpa_reference

    from tokenmill.layers import Attention

    lengths, block = [7, 20, 3], 4
    metadata = profile_metadata(lengths, block, torch.device("cpu"))
    slots = metadata.slot_mapping.tolist()
    assert len(set(slots)) == sum(lengths)  # every token its own slot
    for i, n in enumerate(lengths):  # each request's tokens sit in its table's blocks, in order
        start = int(metadata.query_start_loc_cpu[i])
        table = metadata.block_table[i].tolist()
        assert slots[start:start + n] == [table[p // block] * block + p % block for p in range(n)]
    generator = torch.Generator().manual_seed(0)
    total, blocks = sum(lengths), int(metadata.block_table.max()) + 1
    case = PagedCase(metadata, torch.randn(total, 4, 8, generator=generator), torch.randn(total, 2, 8, generator=generator),
                     torch.randn(total, 2, 8, generator=generator), torch.zeros(blocks, block, 2, 8),
                     torch.zeros(blocks, block, 2, 8))
    layer = Attention(4, 8, 2, 8**-0.5)
    out = sdpa_reference(layer, case)
    for i, n in enumerate(lengths):
        start = int(metadata.query_start_loc_cpu[i])
        q = case.query[start:start + n].transpose(0, 1)
        k = case.key[start:start + n].repeat_interleave(2, 1).transpose(0, 1)
        v = case.value[start:start + n].repeat_interleave(2, 1).transpose(0, 1)
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=8**-0.5)
        torch.testing.assert_close(out[start:start + n], expected.transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_profiling_the_largest_step_leaves_the_engine_as_it_was(model_factory, reference):  # noqa: F811
    llm = LLM(str(model_factory("llama")), dtype="float32", max_model_len=128, kv_cache_memory="32MiB",
              max_num_batched_tokens=300)
    model_runner = runner(llm)
    caches = [layer.kv_cache for layer in model_runner.attention_layers]
    profile_forward(model_runner, 300)()  # more than max_model_len: split into prompts of 128
    assert all(layer.kv_cache is cache for layer, cache in zip(model_runner.attention_layers, caches, strict=True))
    outputs = llm.generate([{"prompt_token_ids": p} for p in _prompts(1)], _greedy())
    _assert_matches(outputs, reference("llama", (1,)))
