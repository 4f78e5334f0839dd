"""FP8 checkpoints end to end: written in the ``fp8`` on-disk layout (tests/fp8_models.py),
loaded by ``LLM(path)`` with no flag, generating what transformers generates on the
dequantised weights.

Tolerance: the weights are the dequantised ones exactly, but tokenmill also rounds
each activation row to e4m3 before every matmul, which transformers does not: 3
mantissa bits, a relative error up to 2**-4 per element, about 2.7% RMS. The tiny
Llama's 14 matmuls compound that to a few percent of the final hidden state; its
logits have a spread of about 4 (RMS-normed 64-wide hidden, lm_head weights of std
0.5), so each logit moves by about 0.1 and a chosen-token logprob (a difference of
logits) by up to about 3 sigma of that, 0.3 nat; 0.35 allows for the accumulation
order (measured: 0.16 per tensor, 0.21 per channel, 0.15 block-wise; 123-125 of 128
positions matching). Tokens whose top two logits lie closer than that may flip,
hence "95% of positions" rather than all, counted by teacher forcing
(tests/quant_agreement.py).

That is the torch path (``_scaled_mm``, or the reference, W8A8). On a CPU where the weight-only
kernel builds (tokenmill_quant_fp8/cpu_kernel.py) the activations are not rounded at all: the
kernel multiplies the dequantised weights exactly, so only float32 summation order remains, and
every token matches with chosen-token logprobs within 1e-4 (measured: 2.4e-6, all 128
positions, every scheme; the static scheme's input_scale is not applied there).
"""

from __future__ import annotations

import json
import random
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
from fp8_models import SCHEMES, build_fp8_pair, static_input_rounding
from quant_agreement import agreement_with_transformers, greedy_with_logprobs, rewrite_checkpoint, weight_storage
from safetensors import safe_open
from tiny_models import build_model

from tokenmill import LLM
from tokenmill_quant_fp8.cpu_kernel import load_fp8_cpu_kernel

MAX_NEW = 16
LOGPROB_TOLERANCE = 0.35
WEIGHT_ONLY_LOGPROB_TOLERANCE = 1e-4  # float32 summation order only


def _prompts(count: int = 8, seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 380) for _ in range(n)] for n in (4, 9, 13, 20, 27, 31, 40, 52)[:count]]


@pytest.fixture(scope="module")
def float_llama(tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module", params=SCHEMES)
def fp8_pair(request, float_llama, tmp_path_factory) -> tuple[Path, Path, str]:
    assert any(ep.name == "fp8" for ep in entry_points(group="tokenmill.plugins")), \
        "plugin 'fp8' is not installed: pip install -e quantization/fp8"
    quantized, dequantized = tmp_path_factory.mktemp("fp8"), tmp_path_factory.mktemp("dequantized")
    build_fp8_pair(float_llama, quantized, dequantized, request.param, calibration=_prompts() + _prompts(seed=11))
    return quantized, dequantized, request.param


def _generate(folder: Path, prompts: list[list[int]], **options) -> tuple[list[list[int]], list[list[float]]]:
    return greedy_with_logprobs(folder, prompts, MAX_NEW, **options)


def test_fp8_checkpoint_generates_like_transformers_on_dequantised_weights(fp8_pair):
    quantized, dequantized, scheme = fp8_pair
    prompts = _prompts()
    tokens, logprobs = _generate(quantized, prompts)
    if load_fp8_cpu_kernel() is not None:  # the CPU's weight-only kernel: the dequantised weights, unrounded inputs
        agreement = agreement_with_transformers(dequantized, prompts, tokens, logprobs)
        assert agreement.fraction == 1.0, f"{scheme}: {agreement}"
        assert agreement.max_logprob_error <= WEIGHT_ONLY_LOGPROB_TOLERANCE, f"{scheme}: {agreement}"
    elif scheme == "static":
        # A static scale is per tensor, so small rows land among e4m3's subnormals and round
        # coarsely (the scheme's price: unrounded, 94% of positions match), so transformers'
        # linear inputs are rounded the same way. What remains: float32 accumulation order,
        # which can tip an element to the other side of an e4m3 rounding boundary (a 6% step).
        agreement = agreement_with_transformers(dequantized, prompts, tokens, logprobs,
                                                static_input_rounding(quantized))
        assert agreement.fraction >= 0.95, agreement
        assert agreement.max_logprob_error <= LOGPROB_TOLERANCE, agreement
    else:
        agreement = agreement_with_transformers(dequantized, prompts, tokens, logprobs)
        assert agreement.fraction >= 0.95, f"{scheme}: {agreement}"
        assert agreement.max_logprob_error <= LOGPROB_TOLERANCE, f"{scheme}: {agreement}"


def test_the_checkpoint_holds_fp8_within_rounding(fp8_pair, float_llama):
    """The packing: safetensors stores F8_E4M3 weights, and weight * scale is the original
    weight up to e4m3 rounding (half a unit in the last of 3 mantissa bits, relative 2**-4)."""
    quantized, dequantized, _ = fp8_pair
    name = "model.layers.0.mlp.down_proj.weight"
    with safe_open(str(quantized / "model.safetensors"), "pt") as f:
        assert f.get_slice(name).get_dtype() == "F8_E4M3"
    with safe_open(str(dequantized / "model.safetensors"), "pt") as f, \
            safe_open(str(float_llama / "model.safetensors"), "pt") as g:
        ours, original = f.get_tensor(name), g.get_tensor(name)
    assert not torch.equal(ours, original)
    normal = original.abs() > original.abs().max() * 2 ** -6  # subnormals round in absolute, not relative, terms
    assert ((ours - original).abs()[normal] <= original.abs()[normal] * 2 ** -4 + 1e-12).all()


def test_online_fp8_of_a_float_checkpoint_is_the_per_channel_checkpoint(float_llama, tmp_path):
    """``quantization="fp8"`` on a float checkpoint quantizes each decoder weight per
    output channel at load, exactly as tests/fp8_models.py's per-channel quantizer does
    (``max|W_row| / 448``, round to e4m3): the same tokens and logprobs as that checkpoint."""
    quantized = tmp_path / "fp8"
    build_fp8_pair(float_llama, quantized, tmp_path / "ref", "per-channel")
    prompts = _prompts()
    online = _generate(float_llama, prompts, quantization="fp8")
    assert online == _generate(quantized, prompts)
    assert online != _generate(float_llama, prompts), "online fp8 changed nothing"


def test_a_weight_scale_of_the_wrong_shape_is_refused_at_load(float_llama, tmp_path):
    quantized, dequantized = tmp_path / "fp8", tmp_path / "ref"
    build_fp8_pair(float_llama, quantized, dequantized, "per-channel")
    name = "model.layers.1.self_attn.k_proj.weight_scale"
    bad = rewrite_checkpoint(quantized, tmp_path / "bad", lambda t: t.__setitem__(name, t[name][:-3]))
    with pytest.raises(ValueError, match=r"k_proj\.weight_scale|qkv_proj\.weight_scale"):
        LLM(str(bad), dtype="float32", max_model_len=64, kv_cache_memory="8MiB")


def test_a_float_weight_where_fp8_is_declared_is_refused_at_load(float_llama, tmp_path):
    quantized, dequantized = tmp_path / "fp8", tmp_path / "ref"
    build_fp8_pair(float_llama, quantized, dequantized, "per-tensor")
    name = "model.layers.0.mlp.up_proj.weight"
    bad = rewrite_checkpoint(quantized, tmp_path / "bad", lambda t: t.__setitem__(name, t[name].float()))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        LLM(str(bad), dtype="float32", max_model_len=64, kv_cache_memory="8MiB")


def test_block_scales_of_the_wrong_shape_and_blocks_that_split_a_shard_are_refused(float_llama, tmp_path):
    quantized, dequantized = tmp_path / "fp8", tmp_path / "ref"
    build_fp8_pair(float_llama, quantized, dequantized, "block")
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    bad = rewrite_checkpoint(quantized, tmp_path / "bad", lambda t: t.__setitem__(name, t[name][:, :1].contiguous()))
    with pytest.raises(ValueError, match="weight_scale_inv"):
        LLM(str(bad), dtype="float32", max_model_len=64, kv_cache_memory="8MiB")
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [48, 48]  # k/v shards have 32 rows
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="not whole blocks"):
        LLM(str(quantized), dtype="float32", max_model_len=64, kv_cache_memory="8MiB")


@pytest.mark.parametrize(("change", "message"), [
    ({"activation_scheme": "per-batch"}, "activation_scheme 'per-batch' is not one of dynamic, static"),
    ({"weight_block_size": [128]}, "weight_block_size must be two positive integers"),
    ({"weight_block_size": [32, 32], "activation_scheme": "static"}, "block-wise weights .* need activation_scheme"),
])
def test_a_config_the_method_cannot_follow_is_refused_by_field(float_llama, tmp_path, change, message):
    quantized = tmp_path / "fp8"
    build_fp8_pair(float_llama, quantized, tmp_path / "ref", "per-tensor")
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"].update(change)
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        LLM(str(quantized), dtype="float32", max_model_len=64, kv_cache_memory="8MiB")


def _assert_decoder_weights_take_one_byte(llm: LLM, float_llama: Path) -> None:
    dtypes, total = weight_storage(llm)
    _, float_total = weight_storage(LLM(str(float_llama), dtype="float32", max_model_len=64, kv_cache_memory="8MiB"))
    assert {dtype for prefix, dtype in dtypes.items() if prefix != "lm_head"} == {torch.float8_e4m3fn}, dtypes
    assert dtypes["lm_head"] == torch.float32
    rows = 64 + 32 + 32 + 64 + 128 + 128 + 64  # q, k, v, o, gate, up, down of the tiny Llama (hidden 64, MLP 128)
    decoder = 2 * (64 * (rows - 64) + 128 * 64)  # weight elements in its 2 layers (down_proj is 64 x 128)
    scales = 2 * rows * 4 + 64  # at most one float32 per row, and the static input scales
    assert float_total - total >= 3 * decoder - scales  # 4 bytes became 1, no float copy kept


def test_a_checkpoints_decoder_weights_are_held_in_one_byte(fp8_pair, float_llama):
    quantized, _, _ = fp8_pair
    _assert_decoder_weights_take_one_byte(LLM(str(quantized), dtype="float32", max_model_len=64,
                                              kv_cache_memory="8MiB"), float_llama)


def test_online_fp8_keeps_no_float_copy(float_llama):
    _assert_decoder_weights_take_one_byte(LLM(str(float_llama), dtype="float32", max_model_len=64,
                                              kv_cache_memory="8MiB", quantization="fp8"), float_llama)
