"""Mixture-of-experts models against transformers ``generate`` on the same weights (float32):
greedy tokens identical, chosen-token logprobs within 1e-3, for 8 prompts of 5 to 60
tokens; also with chunked prefill, with preemption, with prefix-cache hits (DeepSeek's
latent attention) and with two tensor-parallel ranks."""

from __future__ import annotations

import functools
import json
import random
import shutil
from pathlib import Path

import pytest
from moe_models import build_moe_model
from safetensors.torch import load_file, save_file
from test_golden import _assert_matches
from tiny_models import hf_greedy
from worker_probe import attention_backend

from tokenmill import LLM, SamplingParams

MAX_NEW = 12
ARCHS = ["mixtral", "qwen2-moe", "qwen3-moe", "deepseek-v2", "deepseek-v3"]
DEEPSEEK = ["deepseek-v2", "deepseek-v3"]


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return functools.cache(lambda arch: build_moe_model(tmp_path_factory.mktemp(arch), arch))


@pytest.fixture(scope="module")
def reference(moe_path):
    @functools.cache
    def get(arch: str, shared_prefix: int = 0) -> list:
        return hf_greedy(moe_path(arch), _prompts(shared_prefix), MAX_NEW)

    return get


def _prompts(shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(1)
    if not shared_prefix:
        return [[rng.randrange(3, 380) for _ in range(n)] for n in (5, 9, 17, 23, 31, 40, 47, 60)]
    prefix = [rng.randrange(3, 380) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(3, 380) for _ in range(n)] for n in (5, 9, 17, 23, 31, 40)]


def _generate(llm: LLM, prompts: list[list[int]] | None = None) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    return llm.generate([{"prompt_token_ids": p} for p in (prompts or _prompts())], params)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(arch, moe_path, reference):
    llm = LLM(str(moe_path(arch)), dtype="float32", max_model_len=128, kv_cache_memory="32MiB")
    _assert_matches(_generate(llm), reference(arch))


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_of_16_tokens(arch, moe_path, reference):
    llm = LLM(str(moe_path(arch)), dtype="float32", max_model_len=128, kv_cache_memory="32MiB",
              max_num_batched_tokens=16)
    _assert_matches(_generate(llm), reference(arch))


@pytest.mark.parametrize("arch", ARCHS)
def test_preemption_recomputes_exactly(arch, moe_path, reference):
    # 10 blocks of 16 tokens: 8 prompts of up to 72 tokens cannot all stay resident.
    llm = LLM(str(moe_path(arch)), dtype="float32", max_model_len=128, num_kv_blocks=10)
    outputs = _generate(llm)
    assert llm.engine.scheduler_stats.num_preemptions > 0
    _assert_matches(outputs, reference(arch))


@pytest.mark.parametrize("backend", ["sdpa", "cpu-paged"])
@pytest.mark.parametrize("arch", DEEPSEEK)
def test_latent_attention_on_each_attention_backend(arch, backend, moe_path, reference):
    """Whichever backend the engine chose, the latent layers run the core's latent reference
    over their own cache (tokenmill.attention.latent): the tokens stay transformers'."""
    llm = LLM(str(moe_path(arch)), dtype="float32", max_model_len=128, kv_cache_memory="32MiB",
              attention_backend=backend)
    assert attention_backend(llm) == backend
    _assert_matches(_generate(llm), reference(arch))


@pytest.mark.parametrize("arch", DEEPSEEK)
def test_prefix_cache_hits_with_chunked_prefill_match_transformers(arch, moe_path, reference):
    """The latent cache is paged as any other: a later request reuses the blocks holding a
    40-token shared prefix's latents, its prompt arriving in chunks of 16."""
    llm = LLM(str(moe_path(arch)), dtype="float32", max_model_len=128, kv_cache_memory="32MiB",
              max_num_batched_tokens=16, enable_prefix_caching=True)
    prompts = _prompts(shared_prefix=40)
    outputs = _generate(llm, prompts[:1]) + _generate(llm, prompts[1:])
    _assert_matches(outputs, reference(arch, shared_prefix=40))
    assert all(out.num_cached_tokens >= 32 for out in outputs[1:]), [o.num_cached_tokens for o in outputs]


@pytest.mark.parametrize("arch", DEEPSEEK)
def test_the_latent_cache_holds_more_blocks_in_the_same_memory(arch, moe_path, reference):
    """A token and layer cache kv_lora_rank + qk_rope_head_dim = 40 numbers, not the decompressed
    2 * 4 heads * 32 (keys and values): 150 KiB, which held 3 blocks of 16 tokens (fewer than one
    128-token sequence needs), holds 20, and the 8 prompts (25 blocks) run through them, preempted."""
    config = json.loads((moe_path(arch) / "config.json").read_text())
    layers, budget = config["num_hidden_layers"], 150 * 1024
    latent = layers * 16 * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 4
    head = max(config["qk_nope_head_dim"] + config["qk_rope_head_dim"], config["v_head_dim"])
    decompressed = layers * 16 * 2 * config["num_attention_heads"] * head * 4
    assert (budget // decompressed, budget // latent) == (3, 20)
    llm = LLM(str(moe_path(arch)), dtype="float32", max_model_len=128, kv_cache_memory="150KiB")
    assert llm.engine.model_info.num_kv_blocks == budget // latent
    _assert_matches(_generate(llm), reference(arch))
    assert llm.engine.scheduler_stats.num_preemptions > 0


def test_an_fp8_latent_cache_holds_four_times_the_blocks(moe_path, reference):
    """One byte a latent number, not float32's four; the entries read back at their scale give
    transformers' first token for every prompt (later ones drift with the rounding: 68 of 96
    positions before the first difference, measured)."""
    llm = LLM(str(moe_path("deepseek-v2")), dtype="float32", max_model_len=128, kv_cache_memory="150KiB",
              kv_cache_dtype="fp8")
    assert llm.engine.model_info.num_kv_blocks == 4 * 20
    outputs = _generate(llm)
    assert [out.outputs[0].token_ids[0] for out in outputs] == [tokens[0] for tokens, _ in reference("deepseek-v2")]


@pytest.mark.parametrize("arch", ["mixtral", "qwen2-moe", "deepseek-v3"])
def test_two_tensor_parallel_ranks_match_transformers(arch, moe_path, reference):
    """Each rank holds half of every expert's intermediate columns (and of the shared
    expert's); the all-reduced outputs give transformers' tokens, with chunked prefill and
    preemption (where requests finishing together once left the ranks' batches in
    different row orders: the removals followed each process's set order)."""
    llm = LLM(str(moe_path(arch)), dtype="float32", max_model_len=128, num_kv_blocks=10,
              max_num_batched_tokens=16, tensor_parallel_size=2)
    assert llm.engine.config.distributed_executor_backend == "mp"
    outputs = _generate(llm)
    assert llm.engine.scheduler_stats.num_preemptions > 0
    _assert_matches(outputs, reference(arch))
    llm.engine.shutdown()


def _copy_with_tensors(source: Path, target: Path, edit) -> Path:
    shutil.copytree(source, target, dirs_exist_ok=True)
    tensors = load_file(target / "model.safetensors")
    edit(tensors)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


def test_a_missing_expert_tensor_is_named(moe_path, tmp_path):
    name = "model.layers.1.block_sparse_moe.experts.5.w3.weight"
    folder = _copy_with_tensors(moe_path("mixtral"), tmp_path, lambda tensors: tensors.pop(name))
    with pytest.raises(Exception, match=f"lacks expert tensor {name.replace('.', '[.]')}"):
        LLM(str(folder), dtype="float32", max_model_len=64, kv_cache_memory="8MiB")


def test_an_expert_tensor_of_the_wrong_shape_is_named(moe_path, tmp_path):
    name = "model.layers.0.mlp.experts.2.down_proj.weight"

    def shrink(tensors):
        tensors[name] = tensors[name][:, :-1].contiguous()

    folder = _copy_with_tensors(moe_path("qwen2-moe"), tmp_path, shrink)
    with pytest.raises(Exception, match=rf"{name.replace('.', '[.]')}: checkpoint tensor of shape \(64, 31\)"):
        LLM(str(folder), dtype="float32", max_model_len=64, kv_cache_memory="8MiB")


@pytest.mark.parametrize(("field", "value"), [("scoring_func", "tanh"), ("topk_method", "random")])
def test_an_unsupported_routing_names_the_config_field(field, value, moe_path, tmp_path):
    shutil.copytree(moe_path("qwen3-moe"), tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match=f"unsupported MoE routing: {field}='{value}'"):
        LLM(str(tmp_path), dtype="float32", max_model_len=64, kv_cache_memory="8MiB")


def _expert_loads(worker) -> dict[str, list[int]]:
    from tokenmill.layers import expert_load_by_layer

    return expert_load_by_layer(worker.runner.model, reset=True)


def test_expert_load_counts_every_routed_token(moe_path):
    """Each MoE layer counts top-k experts per computed token: prompts plus all but the
    last sampled token of each request (the last one is never fed back)."""
    from tokenmill.layers import load_imbalance

    llm = LLM(str(moe_path("qwen2-moe")), dtype="float32", max_model_len=128, kv_cache_memory="32MiB")
    llm.engine.core.executor.collective_rpc(_expert_loads)  # start from zero
    _generate(llm)
    loads = llm.engine.core.executor.collective_rpc(_expert_loads)[0]
    assert sorted(loads) == ["model.layers.0.mlp.experts", "model.layers.2.mlp.experts"]  # layer 1 is dense
    computed = sum(len(p) for p in _prompts()) + len(_prompts()) * (MAX_NEW - 1)
    for layer, load in loads.items():
        assert len(load) == 8 and sum(load) == 2 * computed, layer
        assert 1.0 <= load_imbalance(load) <= 8.0


def test_deepseek_v3_skips_the_multi_token_prediction_layer(moe_path, reference, tmp_path):
    """Published V3 checkpoints carry a layer past ``num_hidden_layers`` for multi-token
    prediction; decoding does not use it (transformers skips it too)."""
    import torch

    def add_mtp_layer(tensors):
        tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
        tensors["model.layers.3.mlp.experts.0.gate_proj.weight"] = torch.zeros(32, 64)

    folder = _copy_with_tensors(moe_path("deepseek-v3"), tmp_path, add_mtp_layer)
    llm = LLM(str(folder), dtype="float32", max_model_len=128, kv_cache_memory="32MiB")
    _assert_matches(_generate(llm), reference("deepseek-v3"))
