"""LoRA decode steps through step graphs (the CPU platform's C++ LoRA kernel, which the graph
records): the same tokens and logprobs as the same requests run eagerly, also when a graph was
captured at a step none of whose requests had an adapter. tests/test_lora_golden.py checks
these engines' output against peft."""

from __future__ import annotations

import random

import pytest
from lora_models import ADAPTERS, build_adapter
from worker_probe import runner

from tokenmill import LLM, LoRARequest, SamplingParams
from tokenmill_platform_cpu.kernels import kernels_available

pytestmark = pytest.mark.skipif(not kernels_available(), reason="no C++ compiler to build the CPU kernels")

PLAN = ["attn-r4", None, "all-r8", "mlp-rs16", "all-r8", None]


@pytest.fixture(scope="module")
def adapters(llama_path, tmp_path_factory) -> dict[str, LoRARequest]:
    folders = {name: build_adapter(llama_path, tmp_path_factory.mktemp(name), seed=i, **args)
               for i, (name, args) in enumerate(ADAPTERS.items())}
    return {name: LoRARequest(name, i + 1, str(folder)) for i, (name, folder) in enumerate(folders.items())}


def _engine(path, **options) -> LLM:
    return LLM(str(path), dtype="float32", max_model_len=128, kv_cache_memory="32MiB", enable_lora=True, max_loras=4,
               max_lora_rank=16, **options)


def _greedy(llm: LLM, plan: list[str | None], adapters: dict[str, LoRARequest]) -> list[tuple[list[int], list[float]]]:
    rng = random.Random(3)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 380) for _ in range(rng.randrange(4, 30))]} for _ in plan]
    # requests finishing one after another: decode batches of every size from len(plan) down to one
    params = [SamplingParams(temperature=0.0, max_tokens=3 + 2 * i, ignore_eos=True, logprobs=0)
              for i in range(len(plan))]
    outputs = llm.generate(prompts, params, lora_request=[adapters[n] if n else None for n in plan])
    return [(out.outputs[0].token_ids, [next(iter(step.values())).logprob for step in out.outputs[0].logprobs])
            for out in outputs]


def _assert_same(ours, eager) -> None:
    for i, ((tokens, logprobs), (eager_tokens, eager_logprobs)) in enumerate(zip(ours, eager, strict=True)):
        assert tokens == eager_tokens, f"prompt {i}: greedy tokens differ from the eager run's"
        assert logprobs == pytest.approx(eager_logprobs, abs=1e-5), f"prompt {i}: logprobs differ"


def test_lora_decode_steps_replay_graphs_captured_without_adapters(llama_path, adapters):
    """The first call (the base model alone) captures the graphs of every batch size up to six;
    the second replays them with three adapters in the batch, the third with two other ones."""
    eager = _engine(llama_path, enforce_eager=True)
    graphed = _engine(llama_path)
    graphs = runner(graphed).graphs
    assert graphs is not None
    for plan in ([None] * len(PLAN), PLAN, list(reversed(PLAN))):
        _assert_same(_greedy(graphed, plan, adapters), _greedy(eager, plan, adapters))
    assert graphs.batch_sizes == [1, 2, 3, 4, 5, 6] and graphs.eager_batch_sizes == []


def test_without_the_kernel_lora_steps_run_eagerly(llama_path, adapters, monkeypatch):
    """A platform without the LoRA kernel (here: the CPU's, hidden) gets no step graphs with LoRA;
    its torch path (segments, dense) gives what the kernel gives."""
    from tokenmill_platform_cpu.layer_ops import CpuLayerOps

    with_kernel = _greedy(_engine(llama_path, enforce_eager=True), PLAN, adapters)
    monkeypatch.delattr(CpuLayerOps, "lora_delta_supported")
    llm = _engine(llama_path)
    assert runner(llm).graphs is None
    without = _greedy(llm, PLAN, adapters)
    for (tokens, logprobs), (kernel_tokens, kernel_logprobs) in zip(without, with_kernel, strict=True):
        assert tokens == kernel_tokens
        assert logprobs == pytest.approx(kernel_logprobs, abs=1e-4)
