"""LoRA under tensor parallelism: each rank holds its part of an adapter, split as its base
layer is (column-parallel: B's rows of the rank's output slice, A whole; row-parallel: A's
columns of the rank's input slice, B whole, the shrunk activations all-reduced).

The layer tests build two ranks' layers in this process (the one-rank no-op communicator,
the collective done by hand as tests/test_tensor_parallel.py does) against the unsplit layer;
the engine test runs the "mp" executor (two processes over gloo on 127.0.0.1) on a mixed batch
of three adapters and the base, against one rank.
"""

from __future__ import annotations

import random

import pytest
import torch
from lora_models import ADAPTERS, build_adapter

from tokenmill import LLM, LoRARequest, SamplingParams
from tokenmill.layers import Linear, MergedLinear, ModelBuildContext, load_weight
from tokenmill.lora.adapter import LoRAModuleWeights
from tokenmill.lora.layers import LoRABatch, wrap_linear

RANK, SLOTS = 3, 2


def _context(rank: int = 0, world_size: int = 1) -> ModelBuildContext:
    return ModelBuildContext(hf_config=None, rank=rank, world_size=world_size, params_dtype=torch.float32)


def _adapter(out_features: int, in_features: int, seed: int) -> LoRAModuleWeights:
    generator = torch.Generator().manual_seed(seed)
    return LoRAModuleWeights(torch.randn(RANK, in_features, generator=generator),
                             torch.randn(out_features, RANK, generator=generator))


def _with_lora(layer: Linear, slices: list[LoRAModuleWeights | None], mask: torch.Tensor) -> Linear:
    batch = LoRABatch()
    weights = wrap_linear(layer, SLOTS, RANK + 1, batch)  # rank padded: max_rank above the adapter's
    weights.set_slot(1, slices)
    batch.token_mask = mask
    return layer


def _mask(tokens: int) -> torch.Tensor:
    """Tokens on slot 1, on slot 0 (empty: no adapter there) and on the base model, alternating."""
    mask = torch.zeros(tokens, SLOTS)
    mask[0::3, 1] = 1
    mask[1::3, 0] = 1
    return mask


def test_column_parallel_merged_qkv_with_replicated_kv_heads_splits_b_by_rows():
    """q of 4 heads over 2 ranks, k/v of 1 head replicated: each rank's LoRA output is its slice."""
    torch.manual_seed(0)
    head, hidden, sizes = 2, 6, [4 * 2, 2, 2]
    weights = [torch.randn(size, hidden) for size in sizes]
    adapter = [_adapter(size, hidden, seed) for seed, size in enumerate(sizes)]
    x, mask = torch.randn(5, hidden), _mask(5)
    full = MergedLinear(hidden, sizes, ctx=_context())
    for shard, weight in enumerate(weights):
        load_weight(full.weight, weight, shard)
    fq, fk, fv = full.split(_with_lora(full, adapter, mask)(x))
    assert not torch.allclose(fq, full.split(x @ full.weight.T)[0])  # the adapter changes the output
    for rank in range(2):
        layer = MergedLinear(hidden, sizes, ctx=_context(rank, 2), parallel="column", shard_parts=[2, 1, 1])
        for shard, weight in enumerate(weights):
            load_weight(layer.weight, weight, shard)
        rq, rk, rv = layer.split(_with_lora(layer, adapter, mask)(x))
        torch.testing.assert_close(rq, fq[:, rank * 2 * head:(rank + 1) * 2 * head], rtol=0, atol=1e-5)
        torch.testing.assert_close(rk, fk, rtol=0, atol=1e-5)
        torch.testing.assert_close(rv, fv, rtol=0, atol=1e-5)


def test_row_parallel_partials_with_lora_sum_to_the_whole_layer():
    """Each rank shrinks its slice of the input; the sum over ranks (here by hand, for the
    shrunk activations and the base partials alike) is the unsplit layer with its adapter."""
    torch.manual_seed(1)
    weight, adapter = torch.randn(5, 8), [_adapter(5, 8, seed=3)]
    x, mask = torch.randn(4, 8), _mask(4)
    full = _with_lora(Linear(8, 5, ctx=_context()), adapter, mask)
    load_weight(full.weight, weight)
    partials = []
    for rank in range(2):
        layer = Linear(8, 5, ctx=_context(rank, 2), parallel="row")
        load_weight(layer.weight, weight)
        partials.append(_with_lora(layer, adapter, mask)(x[:, rank * 4:(rank + 1) * 4]))
    torch.testing.assert_close(partials[0] + partials[1], full(x), rtol=0, atol=1e-5)


MAX_NEW = 10
PLAN = ["attn-r4", "all-r8", "mlp-rs16", None, "mlp-rs16", None, "attn-r4", "all-r8"]


def _generate(llm: LLM, adapters: dict[str, LoRARequest]) -> tuple[list[list[int]], list[float]]:
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 380) for _ in range(n)] for n in (5, 9, 17, 23, 31, 40, 47, 60)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                           lora_request=[adapters.get(n) if n else None for n in PLAN])
    llm.engine.shutdown()
    return ([list(out.outputs[0].token_ids) for out in outputs],
            [next(iter(step.values())).logprob for out in outputs for step in out.outputs[0].logprobs])


@pytest.mark.parametrize("arch", ["llama", "llama-one-kv-head"])
def test_two_ranks_with_adapters_match_one_rank(arch, model_factory, tmp_path):
    """Three adapters (q/v; every projection; o/gate/down with rsLoRA) and the base in one batch,
    with chunked prefill: two ranks give one rank's tokens and logprobs (one K/V head: k/v's B is
    replicated, not split)."""
    path = model_factory(arch)
    adapters = {name: LoRARequest(name, i + 1, str(build_adapter(path, tmp_path / name, seed=i, **args)))
                for i, (name, args) in enumerate(ADAPTERS.items())}
    options = dict(dtype="float32", max_model_len=128, kv_cache_memory="32MiB", max_num_batched_tokens=32,
                   enable_lora=True, max_loras=4, max_lora_rank=16)
    one_rank = _generate(LLM(str(path), **options), adapters)
    without = _generate(LLM(str(path), dtype="float32", max_model_len=128, kv_cache_memory="32MiB"), {})
    assert [tokens != base for tokens, base in zip(one_rank[0], without[0], strict=True)] == \
        [name is not None for name in PLAN]  # each adapter changes its prompts' output
    llm = LLM(str(path), tensor_parallel_size=2, **options)
    assert llm.engine.config.distributed_executor_backend == "mp"
    tokens, logprobs = _generate(llm, adapters)
    assert tokens == one_rank[0]
    assert logprobs == pytest.approx(one_rank[1], abs=1e-4)


def test_lora_under_pipeline_parallelism_is_refused_before_any_worker_starts(llama_path):
    """Rank 0 holds only the first stage's layers, so it could not check an adapter's targets."""
    with pytest.raises(ValueError, match="LoRA under pipeline parallelism"):
        LLM(str(llama_path), dtype="float32", max_model_len=128, enable_lora=True, pipeline_parallel_size=2)
