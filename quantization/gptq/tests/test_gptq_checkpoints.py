"""GPTQ checkpoints end to end: written in AutoGPTQ's packed layout (tests/gptq_models.py),
loaded by ``LLM(path)`` with no flag, generating what transformers generates on the
dequantised weights.

Weight-only: tokenmill multiplies the float activations by exactly the dequantised
weights (the same float32 formula as the twin's), so only the order of float32
sums differs from transformers (merged q/k/v and gate/up matmuls, the paged
attention kernel): chosen-token logprobs agree to 1e-3 (measured: under 4e-6), and
every position's argmax matches but for a near-tie (95% asked, as for every method).
"""

from __future__ import annotations

import json
import random
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
from gptq_models import GptqRecipe, build_gptq_pair, gptq_tensors, pack_columns, pack_rows, quantize
from quant_agreement import agreement_with_transformers, greedy_with_logprobs, rewrite_checkpoint, weight_storage
from safetensors import safe_open
from tiny_models import build_model

from tokenmill import LLM

MAX_NEW = 16
LOGPROB_TOLERANCE = 1e-3
RECIPES = [
    GptqRecipe(bits=4, group_size=32, sym=True),
    GptqRecipe(bits=4, group_size=32, sym=False, desc_act=True),
    GptqRecipe(bits=4, group_size=-1, sym=False, checkpoint_format="gptq_v2"),
    GptqRecipe(bits=8, group_size=64, sym=False, desc_act=True),
    GptqRecipe(bits=8, group_size=-1, sym=True, checkpoint_format="gptq_v2"),
]


def _prompts(count: int = 8, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 380) for _ in range(n)] for n in (3, 8, 12, 19, 25, 33, 41, 55)[:count]]


def _options() -> dict[str, object]:
    return dict(dtype="float32", max_model_len=64, kv_cache_memory="8MiB")


@pytest.fixture(scope="module")
def float_llama(tmp_path_factory) -> Path:
    assert any(ep.name == "gptq" for ep in entry_points(group="tokenmill.plugins")), \
        "plugin 'gptq' is not installed: pip install -e quantization/gptq"
    return build_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def gptq_pairs(float_llama, tmp_path_factory) -> dict[GptqRecipe, tuple[Path, Path]]:
    pairs = {}
    for recipe in RECIPES:
        quantized, dequantized = tmp_path_factory.mktemp("gptq"), tmp_path_factory.mktemp("dequantized")
        build_gptq_pair(float_llama, quantized, dequantized, recipe)
        pairs[recipe] = quantized, dequantized
    return pairs


@pytest.mark.parametrize("recipe", RECIPES, ids=str)
@pytest.mark.parametrize("backend", ["sdpa", "cpu-paged"])
def test_gptq_checkpoint_generates_like_transformers_on_dequantised_weights(gptq_pairs, recipe, backend):
    if backend == "cpu-paged" and recipe != RECIPES[1]:
        pytest.skip("one recipe is enough to cover the paged backend")
    quantized, dequantized = gptq_pairs[recipe]
    prompts = _prompts()
    tokens, logprobs = greedy_with_logprobs(quantized, prompts, MAX_NEW, attention_backend=backend)
    agreement = agreement_with_transformers(dequantized, prompts, tokens, logprobs)
    assert agreement.fraction >= 0.95, agreement
    assert agreement.max_logprob_error <= LOGPROB_TOLERANCE, agreement


def test_the_packing_is_compressed_tensors_int32_packing():
    """The reference package's packer (``pack_to_int32``: values offset to signed int8, packed
    low bits first) makes the same words as the test's packer, for qweight (along the input)
    and qzeros (along the output), for 4 and 8 bits."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    generator = torch.Generator().manual_seed(3)
    for bits in (4, 8):
        values = torch.randint(0, 2 ** bits, (64, 24), generator=generator, dtype=torch.int32)
        signed = (values - 2 ** (bits - 1)).to(torch.int8)
        assert torch.equal(pack_rows(values, bits), pack_to_int32(signed, bits, packed_dim=0))
        assert torch.equal(pack_columns(values.t().contiguous(), bits), pack_to_int32(signed.t(), bits, packed_dim=1))


def test_the_checkpoint_reads_back_as_its_quantized_values(gptq_pairs, float_llama):
    """Read the file back by hand: nibble ``j`` of qweight word ``[r, n]`` is ``q[8 r + j, n]``,
    the v1 zeros are one below the real ones, and the twin is the dequantised weight."""
    recipe = RECIPES[1]
    quantized, dequantized = gptq_pairs[recipe]
    prefix = "model.layers.0.self_attn.k_proj"
    with safe_open(str(quantized / "model.safetensors"), "pt") as f:
        qweight, qzeros, scales, g_idx = (f.get_tensor(f"{prefix}.{n}") for n in ("qweight", "qzeros", "scales", "g_idx"))
    with safe_open(str(float_llama / "model.safetensors"), "pt") as f:
        original = f.get_tensor(f"{prefix}.weight")
    n, k = original.shape
    assert qweight.dtype == torch.int32 and qweight.shape == (k // 8, n)
    assert qzeros.shape == (k // 32, n // 8) and scales.dtype == torch.float16 and scales.shape == (k // 32, n)
    assert sorted(torch.bincount(g_idx).tolist()) == [32] * (k // 32) and not torch.equal(g_idx, torch.arange(k) // 32)
    q = torch.stack([(qweight >> (4 * j)) & 15 for j in range(8)], dim=1).reshape(k, n)
    zeros = torch.stack([(qzeros >> (4 * j)) & 15 for j in range(8)], dim=2).reshape(k // 32, n) + 1
    ours = (q - zeros[g_idx.long()]).float() * scales[g_idx.long()].float()
    with safe_open(str(dequantized / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor(f"{prefix}.weight"), ours.t())
    step = scales[g_idx.long()].float().t()
    assert ((ours.t() - original).abs() <= step / 2 + 1e-6).all()  # round to nearest within the group's range


def test_decoder_weights_are_held_packed(gptq_pairs, float_llama):
    llm = LLM(str(gptq_pairs[RECIPES[0]][0]), **_options())
    dtypes, total = weight_storage(llm)
    _, float_total = weight_storage(LLM(str(float_llama), **_options()))
    assert "lm_head" in dtypes and dtypes["lm_head"] == torch.float32
    assert total < float_total
    model_params = llm.engine.core.executor.collective_rpc(
        lambda w: sorted({n.rpartition(".")[2] for n, _ in w.runner.model.named_parameters() if ".layers." in n}))[0]
    assert {"qweight", "qzeros", "scales", "g_idx"} <= set(model_params) and "weight" in model_params  # norms only


def test_a_gptq_checkpoint_asked_for_as_another_method_is_refused(gptq_pairs):
    with pytest.raises(Exception, match="does not match the checkpoint's quant_method 'gptq'"):
        LLM(str(gptq_pairs[RECIPES[0]][0]), quantization="int8", **_options())


def _with_config(source: Path, target: Path, **changes: object) -> Path:
    bad = rewrite_checkpoint(source, target, lambda t: None)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"].update(changes)
    (bad / "config.json").write_text(json.dumps(config))
    return bad


@pytest.mark.parametrize(("changes", "message"), [
    ({"bits": 3}, "bits=3: supported are 2, 4, 8"),
    ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ({"group_size": 64}, r"(qzeros|scales): shape \(\d, \d+\), but group_size 64 over \d+ input features makes \d groups"),
    ({"dynamic": {"-:model.layers.0": {}}}, "dynamic"),
])
def test_a_config_the_checkpoint_does_not_match_is_refused_at_load(gptq_pairs, tmp_path, changes, message):
    bad = _with_config(gptq_pairs[RECIPES[0]][0], tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=message):
        LLM(str(bad), **_options())


def test_a_float_tensor_where_qweight_is_declared_is_refused(gptq_pairs, tmp_path):
    name = "model.layers.0.self_attn.o_proj.qweight"
    bad = rewrite_checkpoint(gptq_pairs[RECIPES[0]][0], tmp_path / "bad",
                             lambda t: t.__setitem__(name, t[name].float()))
    with pytest.raises(ValueError, match=r"o_proj\.qweight: expected packed int32"):
        LLM(str(bad), **_options())


def test_merged_projections_with_different_act_orders_are_refused(gptq_pairs, tmp_path):
    name = "model.layers.1.mlp.up_proj.g_idx"
    bad = rewrite_checkpoint(gptq_pairs[RECIPES[1]][0], tmp_path / "bad",
                             lambda t: t.__setitem__(name, t[name].flip(0).contiguous()))
    with pytest.raises(ValueError, match="gate_up_proj: the merged projections have different g_idx"):
        LLM(str(bad), **_options())


def test_the_quantizer_rounds_to_the_nearest_level():
    weight = torch.randn(16, 40)
    layer = quantize(weight, GptqRecipe(bits=4, group_size=16, desc_act=True), torch.randperm(40))
    assert layer.scales.shape == (3, 16)  # 40 inputs in groups of 16: the last group is short
    step = layer.scales[layer.g_idx.long()].float().t()
    assert ((layer.dequantized() - weight).abs() <= step / 2 + 1e-6).all()


def _auto_gptq_quant_linear():
    """AutoGPTQ's own packer, ``QuantLinear.pack`` of its ``qlinear_cuda`` module (pure torch and
    numpy), loaded from the file: the package's ``__init__`` imports modelling code that
    transformers 5 no longer supports. AutoGPTQ 0.7.1 installs without a GPU from its sdist
    (``BUILD_CUDA_EXT=0 pip install --no-deps --no-build-isolation auto-gptq==0.7.1``)."""
    import importlib.util

    found = importlib.util.find_spec("auto_gptq")
    if found is None or not found.submodule_search_locations:
        pytest.skip("auto-gptq is not installed (BUILD_CUDA_EXT=0 pip install --no-deps --no-build-isolation "
                    "auto-gptq==0.7.1)")
    path = Path(next(iter(found.submodule_search_locations))) / "nn_modules" / "qlinear" / "qlinear_cuda.py"
    spec = importlib.util.spec_from_file_location("auto_gptq_qlinear_cuda", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.QuantLinear


@pytest.mark.parametrize("recipe", [RECIPES[1], RECIPES[3]], ids=str)
def test_the_packing_is_auto_gptqs(recipe):
    """AutoGPTQ packs the test quantizer's scales, zeros and g_idx into the same qweight and
    (v1) qzeros words. It is given the dequantised weight, so its ``round((W + z s) / s)`` lands
    on the quantizer's integers away from any rounding tie. (Its qzeros hold ``N // 32 * bits``
    words: AutoGPTQ layers have a multiple of 32 outputs.)"""
    quant_linear = _auto_gptq_quant_linear()
    torch.manual_seed(1)
    weight = torch.randn(96, 64)
    layer = quantize(weight, recipe, torch.randperm(64) if recipe.desc_act else None)
    linear = torch.nn.Linear(64, 96, bias=False)
    linear.weight.data = layer.dequantized()
    theirs = quant_linear(recipe.bits, recipe.group_size, 64, 96, bias=False, weight_dtype=torch.float32)
    theirs.pack(linear, layer.scales.float().t(), layer.zeros.t().float(), g_idx=layer.g_idx)
    ours = gptq_tensors(layer, recipe)
    assert torch.equal(theirs.qweight, ours["qweight"])
    assert torch.equal(theirs.qzeros, ours["qzeros"])
