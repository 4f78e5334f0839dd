"""Models built from a ModelBuildContext: prefixes, quant methods, weight loaders and
the shared rotary table, on a real Llama from the model plugin and the example int8
quantization plugin."""

from __future__ import annotations

import pytest
import torch
from tiny_models import COMMON
from tokenmill_example_int8.method import Int8WeightOnlyConfig, Int8WeightOnlyMethod

from tokenmill.layers import (
    Linear,
    MergedLinear,
    ModelBuildContext,
    RotaryEmbedding,
    UnquantizedLinearMethod,
    VocabEmbedding,
    load_weight,
)
from tokenmill_models_llama.llama import LlamaForCausalLM


def _llama(quant_config=None, **extra):
    from transformers import LlamaConfig

    config = LlamaConfig(**{**COMMON, **extra})
    return LlamaForCausalLM(config, ctx=ModelBuildContext(hf_config=config, quant_config=quant_config))


def test_child_contexts_join_prefixes():
    root = ModelBuildContext(hf_config=None)
    assert root.child("model").child("layers.3").child("self_attn").prefix == "model.layers.3.self_attn"
    assert root.child("model").child("").prefix == "model"
    assert root.child("model").shared is root.shared


def test_every_layer_gets_its_checkpoint_prefix_and_the_configs_method():
    model = _llama(Int8WeightOnlyConfig(ignored_layers=["lm_head"]))
    layers = {name: m for name, m in model.named_modules() if isinstance(m, Linear | VocabEmbedding)}
    assert all(m.prefix == name for name, m in layers.items())
    expected = {"model.embed_tokens", "lm_head"} | {
        f"model.layers.{i}.{proj}" for i in range(COMMON["num_hidden_layers"])
        for proj in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")}
    assert set(layers) == expected
    assert isinstance(model.lm_head.quant_method, UnquantizedLinearMethod)
    assert model.lm_head.weight.shape == (COMMON["vocab_size"], COMMON["hidden_size"])
    for name, layer in layers.items():
        if isinstance(layer, Linear) and name != "lm_head":
            assert isinstance(layer.quant_method, Int8WeightOnlyMethod), name
            assert not hasattr(layer, "weight") and layer.qweight.dtype == torch.int8


def test_quant_methods_see_the_merged_shards_and_params_dtype():
    model = _llama(Int8WeightOnlyConfig())
    head = COMMON["hidden_size"] // COMMON["num_attention_heads"]
    q, kv = COMMON["num_attention_heads"] * head, COMMON["num_key_value_heads"] * head
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.output_partition_sizes == [q, kv, kv]
    assert qkv.qweight.shape == (q + 2 * kv, COMMON["hidden_size"]) and qkv.scales.shape == (q + 2 * kv,)
    assert model.model.layers[1].mlp.gate_up_proj.output_partition_sizes == [COMMON["intermediate_size"]] * 2


def test_a_tied_lm_head_stays_float_and_shares_the_embedding():
    model = _llama(Int8WeightOnlyConfig(), tie_word_embeddings=True)
    assert isinstance(model.lm_head.quant_method, UnquantizedLinearMethod)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_linear_and_embedding_parameters_take_the_contexts_dtype():
    from transformers import LlamaConfig

    config = LlamaConfig(**COMMON)
    model = LlamaForCausalLM(config, ctx=ModelBuildContext(hf_config=config, params_dtype=torch.bfloat16))
    layers = [m for m in model.modules() if isinstance(m, Linear | VocabEmbedding)]
    assert layers and all(p.dtype == torch.bfloat16 for m in layers for p in m.parameters())


def test_merged_int8_layer_loads_each_shard_into_its_own_rows_and_scales():
    ctx = ModelBuildContext(hf_config=None, quant_config=Int8WeightOnlyConfig(), prefix="blk.qkv_proj",
                            params_dtype=torch.float32)
    layer = MergedLinear(8, [4, 2, 2], ctx=ctx)
    torch.manual_seed(0)
    shards = [(torch.randint(-127, 128, (n, 8), dtype=torch.int8), torch.rand(n) + 0.5) for n in (4, 2, 2)]
    for i, (q, s) in enumerate(shards):
        load_weight(layer.qweight, q, i)
        load_weight(layer.scales, s[:, None], i)  # [out, 1] is accepted too
    dense = torch.cat([q.float() * s[:, None] for q, s in shards])
    x = torch.randn(3, 8)
    assert torch.allclose(layer(x), x @ dense.T, atol=1e-4)
    with pytest.raises(ValueError, match=r"blk\.qkv_proj.*shard 1"):
        load_weight(layer.qweight, shards[0][0], 1)  # 4 rows for a 2-row shard
    with pytest.raises(ValueError, match="int8"):
        load_weight(layer.qweight, torch.zeros(4, 8), 0)
    with pytest.raises(ValueError, match="3 output shards"):
        load_weight(layer.scales, shards[0][1], 3)


def test_float_linear_loads_shards_without_assuming_the_weight_is_the_only_parameter():
    layer = MergedLinear(4, [3, 5], bias=True, ctx=ModelBuildContext(hf_config=None, params_dtype=torch.float32))
    weights, biases = [torch.randn(3, 4), torch.randn(5, 4)], [torch.randn(3), torch.randn(5)]
    for i in range(2):
        load_weight(layer.weight, weights[i], i)
        load_weight(layer.bias, biases[i], i)
    x = torch.randn(2, 4)
    expected = x @ torch.cat(weights).T + torch.cat(biases)
    assert torch.allclose(layer(x), expected, atol=1e-5)
    assert [t.shape[-1] for t in layer.split(layer(x))] == [3, 5]


def test_all_layers_share_one_rotary_table():
    model = _llama()
    tables = {id(m) for m in model.modules() if isinstance(m, RotaryEmbedding)}
    assert len(tables) == 1
    rotaries = [layer.self_attn.rotary_emb for layer in model.model.layers]
    assert all(r is rotaries[0] for r in rotaries)
    assert rotaries[0].cos_cache.dtype == torch.float32
    assert rotaries[0].cos_cache.shape == (COMMON["max_position_embeddings"], COMMON["hidden_size"] // COMMON["num_attention_heads"])
