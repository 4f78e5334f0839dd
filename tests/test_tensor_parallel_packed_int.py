"""Tensor parallelism for the packed 4-bit methods (GPTQ, AWQ, compressed-tensors pack-quantized).

The layer tests build each rank's layer in this process (a one-rank no-op communicator,
the collective done by hand: column slices concatenated, row partials summed) from
the checkpoint tensors the test builders write, against the unsplit layer on the same
tensors. The engine tests run a tiny Llama in the real on-disk formats with two worker
processes (the "mp" executor, gloo over 127.0.0.1) against one rank, token for token.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from awq_models import build_awq_pair, pack_awq
from awq_models import quantize as awq_quantize
from compressed_tensors_models import build_compressed_pair, compress_weight, preset
from gptq_models import GptqRecipe, build_gptq_pair, gptq_tensors
from gptq_models import quantize as gptq_quantize
from quant_agreement import greedy_with_logprobs
from tiny_models import build_model

from tokenmill import LLM
from tokenmill.layers import Linear, MergedLinear, ModelBuildContext, load_weight
from tokenmill_quant_awq.method import AwqLinearMethod
from tokenmill_quant_compressed_tensors.packed import PackedIntLinearMethod
from tokenmill_quant_gptq.method import GptqLinearMethod, GptqScheme

Tensors = dict[str, torch.Tensor]
MethodFactory = Callable[[], object]


def _ctx(rank: int = 0, world_size: int = 1) -> ModelBuildContext:
    return ModelBuildContext(hf_config=None, prefix="model.layers.0.proj", rank=rank, world_size=world_size,
                             params_dtype=torch.float32)


def _gptq(recipe: GptqRecipe, seed: int) -> tuple[MethodFactory, Callable[[torch.Tensor], Tensors]]:
    scheme = GptqScheme(bits=recipe.bits, group_size=recipe.group_size, desc_act=recipe.desc_act, sym=recipe.sym,
                        zero_version=1 if recipe.checkpoint_format == "gptq" else 2)

    def tensors(weight: torch.Tensor) -> Tensors:
        order = torch.randperm(weight.shape[1], generator=torch.Generator().manual_seed(seed)) \
            if recipe.desc_act else None
        return gptq_tensors(gptq_quantize(weight, recipe, order), recipe)

    return (lambda: GptqLinearMethod(scheme)), tensors


def _awq(group_size: int) -> tuple[MethodFactory, Callable[[torch.Tensor], Tensors]]:
    def tensors(weight: torch.Tensor) -> Tensors:
        q, zeros, scales = awq_quantize(weight, group_size)
        return {"qweight": pack_awq(q), "qzeros": pack_awq(zeros), "scales": scales}

    return (lambda: AwqLinearMethod(group_size)), tensors


def _pack_quantized(name: str, **weights: object) -> tuple[MethodFactory, Callable[[torch.Tensor], Tensors]]:
    scheme = preset(name, **weights)
    args = scheme.weights
    return (lambda: PackedIntLinearMethod(args.num_bits, args.group_size, args.symmetric)), \
        (lambda weight: compress_weight(weight, scheme, "pack-quantized")[0])


METHODS = {
    "gptq-4bit-g16": _gptq(GptqRecipe(bits=4, group_size=16, sym=False), 1),
    "gptq-4bit-g16-act-order": _gptq(GptqRecipe(bits=4, group_size=16, sym=False, desc_act=True), 2),
    "gptq-8bit-one-group": _gptq(GptqRecipe(bits=8, group_size=-1, sym=True, checkpoint_format="gptq_v2"), 3),
    "awq-g16": _awq(16),
    "compressed-tensors-W4A16_ASYM-g16": _pack_quantized("W4A16_ASYM", group_size=16),
    "compressed-tensors-W8A16-channel": _pack_quantized("W8A16", strategy="channel", group_size=None),
}


def _load_shards(layer: Linear, shards: list[Tensors]) -> None:
    for shard_id, tensors in enumerate(shards):
        for name, tensor in tensors.items():
            param = getattr(layer, name)
            if name == "g_idx" or len(shards) == 1:
                load_weight(param, tensor)
            else:
                load_weight(param, tensor, shard_id)
    layer.quant_method.process_weights_after_loading(layer)  # type: ignore[attr-defined]


@pytest.mark.parametrize("method", METHODS, ids=str)
def test_column_parallel_merged_shards_concatenate_to_the_whole_layer(method):
    """q/k/v-like shards of 32, 16 and 16 outputs over two ranks: 16 + 8 + 8 a rank, whole packed words."""
    factory, tensors_of = METHODS[method]
    torch.manual_seed(0)
    sizes, inputs = [32, 16, 16], 64
    shards = [tensors_of(torch.randn(size, inputs)) for size in sizes]
    if "g_idx" in shards[0]:  # the merged projections of one input share its act order
        for tensors in shards[1:]:
            tensors["g_idx"] = shards[0]["g_idx"]
    x = torch.randn(5, inputs)
    full = MergedLinear(inputs, sizes, ctx=_ctx(), quant_method=factory())  # type: ignore[arg-type]
    _load_shards(full, shards)
    expected = full.split(full(x))
    rank_outputs = []
    for rank in range(2):
        layer = MergedLinear(inputs, sizes, ctx=_ctx(rank, 2), parallel="column",
                             quant_method=factory())  # type: ignore[arg-type]
        assert layer.output_partition_sizes == [16, 8, 8]
        _load_shards(layer, shards)
        rank_outputs.append(layer.split(layer(x)))
    for shard, whole in enumerate(expected):
        torch.testing.assert_close(torch.cat([out[shard] for out in rank_outputs], dim=-1), whole, rtol=0, atol=1e-5)


@pytest.mark.parametrize("method", METHODS, ids=str)
def test_row_parallel_partials_sum_to_the_whole_layer(method):
    """64 inputs over two ranks: 32 a rank, two whole groups of 16 (act order: any of the four)."""
    factory, tensors_of = METHODS[method]
    torch.manual_seed(1)
    tensors = tensors_of(torch.randn(24, 64))
    x = torch.randn(5, 64)
    full = Linear(64, 24, ctx=_ctx(), quant_method=factory())  # type: ignore[arg-type]
    _load_shards(full, [tensors])
    partials = []
    for rank in range(2):
        layer = Linear(64, 24, ctx=_ctx(rank, 2), parallel="row", quant_method=factory())  # type: ignore[arg-type]
        _load_shards(layer, [tensors])
        partials.append(layer(x[:, rank * 32:(rank + 1) * 32]))
    torch.testing.assert_close(partials[0] + partials[1], full(x), rtol=0, atol=1e-5)


@pytest.mark.parametrize(("method", "build", "message"), [
    ("gptq-4bit-g16", lambda f: Linear(48, 8, ctx=_ctx(0, 2), parallel="row", quant_method=f()),
     r"model\.layers\.0\.proj: 24 input features per rank over 2 tensor-parallel ranks do not hold whole groups of 16"),
    ("gptq-4bit-g16", lambda f: Linear(64, 24, ctx=_ctx(0, 2), parallel="column", quant_method=f()),
     r"model\.layers\.0\.proj: an output shard of 12 features is not a multiple of 8"),
    ("awq-g16", lambda f: Linear(48, 8, ctx=_ctx(0, 2), parallel="row", quant_method=f()),
     r"model\.layers\.0\.proj: 24 input features per rank do not divide into AWQ groups of 16"),
    ("awq-g16", lambda f: MergedLinear(64, [32, 8], ctx=_ctx(0, 2), parallel="column", quant_method=f()),
     r"model\.layers\.0\.proj: output shards \[16, 4\] \(per rank, over 2 ranks\) are not multiples of 8"),
], ids=["gptq-row-groups", "gptq-column-words", "awq-row-groups", "awq-column-words"])
def test_a_shape_that_does_not_shard_is_a_clear_error_naming_the_layer(method, build, message):
    with pytest.raises(ValueError, match=message):
        build(METHODS[method][0])


def _prompts(count: int = 8, seed: int = 11) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 380) for _ in range(n)] for n in (3, 8, 12, 19, 25, 33, 41, 55)[:count]]


@pytest.fixture(scope="module")
def float_llama(tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("llama"), "llama")


CHECKPOINTS: dict[str, Callable[[Path, Path, Path], None]] = {
    "gptq-4bit-g32": lambda f, q, d: build_gptq_pair(f, q, d, GptqRecipe(bits=4, group_size=32, sym=True)),
    "gptq-4bit-g32-act-order": lambda f, q, d: build_gptq_pair(f, q, d, GptqRecipe(bits=4, group_size=32,
                                                                                   desc_act=True)),
    "awq-g32": lambda f, q, d: build_awq_pair(f, q, d, 32),
    "compressed-tensors-W4A16_ASYM-group32": lambda f, q, d: build_compressed_pair(
        f, q, d, preset("W4A16_ASYM", group_size=32), "pack-quantized"),
    "compressed-tensors-W4A16-channel": lambda f, q, d: build_compressed_pair(
        f, q, d, preset("W4A16", strategy="channel", group_size=None), "pack-quantized"),
}


@pytest.mark.parametrize("checkpoint", CHECKPOINTS, ids=str)
def test_two_ranks_generate_what_one_rank_generates(float_llama, tmp_path, checkpoint):
    """The tiny Llama (hidden 64, 4 heads of 16, 2 KV heads, intermediate 128) over two ranks:
    q/k/v, gate/up column-parallel in whole packed words, o_proj/down_proj row-parallel in
    whole groups of 32. The same float32 products summed in another order: tokens equal,
    logprobs within 1e-4."""
    quantized = tmp_path / "quantized"
    CHECKPOINTS[checkpoint](float_llama, quantized, tmp_path / "dequantized")
    prompts = _prompts()
    one = greedy_with_logprobs(quantized, prompts, 12)
    two = greedy_with_logprobs(quantized, prompts, 12, tensor_parallel_size=2, distributed_executor_backend="mp")
    assert two[0] == one[0]
    assert max(abs(a - b) for ours, theirs in zip(one[1], two[1], strict=True)
               for a, b in zip(ours, theirs, strict=True)) < 1e-4


def test_groups_split_by_the_ranks_are_refused_at_load_naming_the_layer(float_llama, tmp_path):
    """Groups of 64 over o_proj's 64 inputs: 32 a rank, half a group."""
    quantized = tmp_path / "quantized"
    build_gptq_pair(float_llama, quantized, tmp_path / "dequantized", GptqRecipe(bits=8, group_size=64))
    with pytest.raises(Exception, match=r"self_attn\.o_proj: 32 input features per rank over 2 tensor-parallel "
                                        r"ranks do not hold whole groups of 64"):
        LLM(str(quantized), dtype="float32", max_model_len=64, kv_cache_memory="8MiB", tensor_parallel_size=2)
