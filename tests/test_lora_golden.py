"""LoRA adapters against transformers + peft on the same weights (float32): one mixed batch
of prompts on three adapters (different ranks and targets, one rsLoRA) and the base model."""

from __future__ import annotations

import random

import pytest
from lora_models import ADAPTERS, build_adapter, peft_greedy

from tokenmill import LLM, LoRARequest, SamplingParams

MAX_NEW = 10
# the adapter of each of the 8 prompts (None: the base model)
PLAN = ["attn-r4", "all-r8", "mlp-rs16", None, "mlp-rs16", None, "attn-r4", "all-r8"]


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 380) for _ in range(n)] for n in (5, 9, 17, 23, 31, 40, 47, 60)]


@pytest.fixture(scope="module")
def adapters(llama_path, tmp_path_factory) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, str(build_adapter(llama_path, tmp_path_factory.mktemp(name), seed=i, **args)))
            for i, (name, args) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def expected(llama_path, adapters) -> list[tuple[list[int], list[float]]]:
    """transformers + peft, each prompt with its own adapter."""
    prompts = _prompts()
    results = []
    for prompt, name in zip(prompts, PLAN, strict=True):
        folder = adapters[name].lora_path if name is not None else None
        results += peft_greedy(llama_path, folder, [prompt], MAX_NEW)
    return results


def _run(llm: LLM, adapters: dict[str, LoRARequest]) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    loras = [adapters[name] if name is not None else None for name in PLAN]
    return llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, lora_request=loras)


def _assert_matches(outputs, expected) -> None:
    for i, (out, (tokens, logprobs)) in enumerate(zip(outputs, expected, strict=True)):
        completion = out.outputs[0]
        assert completion.token_ids == tokens, f"prompt {i} ({PLAN[i]}): greedy tokens differ from peft"
        ours = [next(iter(step.values())).logprob for step in completion.logprobs]
        assert ours == pytest.approx(logprobs, abs=1e-3), f"prompt {i} ({PLAN[i]}): logprobs differ"


def test_the_adapters_change_the_output(llama_path, expected):
    """Else the golden test below could not fail: each adapter's tokens differ from the base's."""
    base = peft_greedy(llama_path, None, _prompts(), MAX_NEW)
    for i, name in enumerate(PLAN):
        assert (expected[i][0] != base[i][0]) == (name is not None), f"prompt {i} ({name})"


def test_one_mixed_batch_matches_peft(llama_path, adapters, expected):
    llm = LLM(str(llama_path), dtype="float32", max_model_len=128, kv_cache_memory="32MiB", enable_lora=True,
              max_loras=4, max_lora_rank=16)
    _assert_matches(_run(llm, adapters), expected)


def test_more_adapters_than_slots_with_chunked_prefill_and_preemption(llama_path, adapters, expected):
    """Two slots for three adapters, a host cache of two, chunks of 24 tokens and a KV cache too small
    for every request at once: adapters are evicted and reloaded, and every prompt still gets its own."""
    llm = LLM(str(llama_path), dtype="float32", max_model_len=128, num_kv_blocks=12, enable_lora=True,
              max_loras=2, max_cpu_loras=2, max_lora_rank=16, max_num_batched_tokens=24)
    _assert_matches(_run(llm, adapters), expected)
    scheduler = llm.engine.core.scheduler
    assert scheduler.num_preemptions > 0
    assert llm.engine.core.lora is not None and llm.engine.core.lora.load_seconds  # reloads ran
