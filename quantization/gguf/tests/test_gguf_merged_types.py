"""A merged GGUF layer whose shards come in different block types keeps each shard's blocks.

llama.cpp's mixes store q/k/v (and gate/up) of one layer in different types (Q4_K_M: q/k
Q4_K, v Q6_K). The layer is built and loaded shard by shard as a model's
``load_weights`` does it, and multiplied against the shards' dequantised weights (the
torch reference of ``blocks``/``kquants``, itself checked against the gguf package in
``test_gguf_kernels``), with a bias, for one and several tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from test_gguf_kernels import packed

from tokenmill.layers import MergedLinear, ModelBuildContext
from tokenmill.layers.linear import load_weight, process_weights_after_loading
from tokenmill_quant_gguf.blocks import dequantize_rows
from tokenmill_quant_gguf.method import GGUFConfig

Q4_0, Q8_0, F16 = GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0, GGMLQuantizationType.F16
Q4_K, Q6_K = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K


def merged_layer(in_features: int, shards: list[tuple[GGMLQuantizationType, torch.Tensor]],
                 bias: torch.Tensor) -> MergedLinear:
    ctx = ModelBuildContext(hf_config=None, quant_config=GGUFConfig(), prefix="model.layers.0.self_attn.qkv_proj",
                            params_dtype=torch.float32)
    layer = MergedLinear(in_features, [rows.shape[0] for _, rows in shards], bias=True, ctx=ctx)
    params = dict(layer.named_parameters())
    for shard_id, (qtype, rows) in enumerate(shards):
        load_weight(params["qweight_type"], torch.tensor(int(qtype)), shard_id)
        load_weight(params["qweight"], rows, shard_id)
    load_weight(params["bias"], bias)
    process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize(("in_features", "types", "parts"), [
    (256, [Q4_K, Q4_K, Q6_K], (Q4_K, Q6_K)),  # Q4_K_M's q/k/v: q and k one kernel call, v another
    (64, [Q4_0, Q8_0, Q4_0], (Q4_0, Q8_0, Q4_0)),  # runs of a type are consecutive shards only
], ids=["q4_k_m-qkv", "q4_0-q8_0-q4_0"])
@pytest.mark.parametrize("tokens", [1, 7])
def test_shards_of_different_types_keep_their_blocks_and_multiply_as_their_dequantised_weights(
        in_features: int, types: list[GGMLQuantizationType], parts: tuple[GGMLQuantizationType, ...],
        tokens: int) -> None:
    shards = [(qtype, packed(rows, in_features, qtype, seed=i)) for i, (qtype, rows)
              in enumerate(zip(types, [64, 32, 32], strict=True))]
    generator = torch.Generator().manual_seed(tokens)
    bias = torch.randn(128, generator=generator)
    layer = merged_layer(in_features, shards, bias)
    assert layer.quant_method.qtypes == parts  # type: ignore[attr-defined]
    assert not hasattr(layer, "weight")
    assert layer.qweight.numel() == sum(rows.numel() for _, rows in shards)  # the blocks, held once
    weight = torch.cat([dequantize_rows(rows, qtype, in_features) for qtype, rows in shards])
    x = torch.randn(tokens, in_features, generator=generator)
    expected = x.double() @ weight.double().t() + bias.double()
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


def test_a_shard_of_a_type_without_a_kernel_makes_the_layer_float() -> None:
    values = np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)
    f16_rows = torch.from_numpy(np.ascontiguousarray(quantize(values, F16)).view(np.uint8))
    shards = [(Q4_0, packed(64, 64, Q4_0)), (Q8_0, packed(32, 64, Q8_0)), (F16, f16_rows)]
    layer = merged_layer(64, shards, torch.zeros(128))
    assert layer.quant_method.qtypes == ()  # type: ignore[attr-defined]
    weight = torch.cat([dequantize_rows(rows, qtype, 64) for qtype, rows in shards])
    assert torch.equal(layer.weight, weight)
