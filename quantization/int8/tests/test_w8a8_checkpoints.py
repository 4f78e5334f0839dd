"""INT8 W8A8 checkpoints end to end: written in compressed-tensors' int-quantized layout
(tests/w8a8_models.py), loaded by ``LLM(path)`` with no flag, generating what
transformers generates on the dequantised weights.

Tolerance: the weights are the dequantised ones exactly, but tokenmill also rounds
each activation row to 255 levels (``max|x_row| / 127`` a step) before every matmul:
an error of up to half a step per element, about 0.8% of the row's RMS for these
64- and 128-wide rows (their maximum is 3-4 RMS), against e4m3's 2.7% (see
quantization/fp8/tests/test_fp8_checkpoints.py, whose 0.35 nat bound on a
chosen-token logprob this scales: 0.35 * 0.8 / 2.7 = 0.10; measured: 0.036, 127 of
128 positions matching). Tokens whose top two logits lie closer than that may flip,
hence 95% of positions, counted by teacher forcing (tests/quant_agreement.py).
"""

from __future__ import annotations

import json
import random
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
from quant_agreement import agreement_with_transformers, greedy_with_logprobs, rewrite_checkpoint, weight_storage
from safetensors import safe_open
from tiny_models import build_model
from w8a8_models import build_w8a8_pair

from tokenmill import LLM

MAX_NEW = 16
LOGPROB_TOLERANCE = 0.10


def _prompts(count: int = 8, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 380) for _ in range(n)] for n in (3, 8, 12, 19, 25, 33, 41, 55)[:count]]


@pytest.fixture(scope="module")
def float_llama(tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def w8a8_pair(float_llama, tmp_path_factory) -> tuple[Path, Path]:
    installed = {ep.name for ep in entry_points(group="tokenmill.plugins")}
    assert "int8" in installed, "plugin 'int8' is not installed: pip install -e quantization/int8"
    assert "compressed_tensors" in installed, \
        "plugin 'compressed_tensors' (which reads these checkpoints' config) is not installed: " \
        "pip install -e quantization/compressed-tensors"
    quantized, dequantized = tmp_path_factory.mktemp("w8a8"), tmp_path_factory.mktemp("dequantized")
    build_w8a8_pair(float_llama, quantized, dequantized)
    return quantized, dequantized


@pytest.mark.parametrize("backend", ["sdpa", "cpu-paged"])
def test_w8a8_checkpoint_generates_like_transformers_on_dequantised_weights(w8a8_pair, backend):
    quantized, dequantized = w8a8_pair
    prompts = _prompts()
    tokens, logprobs = greedy_with_logprobs(quantized, prompts, MAX_NEW, attention_backend=backend)
    agreement = agreement_with_transformers(dequantized, prompts, tokens, logprobs)
    assert agreement.fraction >= 0.95, agreement
    assert agreement.max_logprob_error <= LOGPROB_TOLERANCE, agreement


def test_the_checkpoint_holds_int8_within_half_a_step(w8a8_pair, float_llama):
    quantized, dequantized = w8a8_pair
    name = "model.layers.0.self_attn.v_proj.weight"
    with safe_open(str(quantized / "model.safetensors"), "pt") as f:
        assert f.get_slice(name).get_dtype() == "I8"
        scale = f.get_tensor(name.replace(".weight", ".weight_scale"))
    with safe_open(str(dequantized / "model.safetensors"), "pt") as f, \
            safe_open(str(float_llama / "model.safetensors"), "pt") as g:
        ours, original = f.get_tensor(name), g.get_tensor(name)
    assert scale.shape == (original.shape[0], 1)
    assert not torch.equal(ours, original)
    assert ((ours - original).abs() <= scale / 2 + 1e-7).all()


def test_online_int8_of_a_float_checkpoint_is_the_w8a8_checkpoint(w8a8_pair, float_llama):
    """``quantization="int8"`` quantizes each decoder weight per channel at load exactly as
    tests/w8a8_models.py does: the same tokens and logprobs as that checkpoint."""
    quantized, _ = w8a8_pair
    prompts = _prompts()
    online = greedy_with_logprobs(float_llama, prompts, MAX_NEW, quantization="int8")
    assert online == greedy_with_logprobs(quantized, prompts, MAX_NEW)
    assert online != greedy_with_logprobs(float_llama, prompts, MAX_NEW), "online int8 changed nothing"


def test_a_weight_scale_of_the_wrong_shape_is_refused_at_load(w8a8_pair, tmp_path):
    quantized, _ = w8a8_pair
    name = "model.layers.1.mlp.gate_proj.weight_scale"
    bad = rewrite_checkpoint(quantized, tmp_path / "bad", lambda t: t.__setitem__(name, t[name].reshape(1, -1)))
    with pytest.raises(ValueError, match=r"gate_up_proj\.weight_scale.*expected \[128, 1\]"):
        LLM(str(bad), dtype="float32", max_model_len=64, kv_cache_memory="8MiB")


def test_a_float_weight_where_int8_is_declared_is_refused_at_load(w8a8_pair, tmp_path):
    quantized, _ = w8a8_pair
    name = "model.layers.0.self_attn.o_proj.weight"
    bad = rewrite_checkpoint(quantized, tmp_path / "bad", lambda t: t.__setitem__(name, t[name].float()))
    with pytest.raises(ValueError, match=r"o_proj\.weight: expected an int8 tensor"):
        LLM(str(bad), dtype="float32", max_model_len=64, kv_cache_memory="8MiB")


@pytest.mark.parametrize(("path", "value", "message"), [
    (("format",), "pack-quantized", "format 'pack-quantized'"),
    (("config_groups", "group_0", "weights", "symmetric"), False, "weights.symmetric is False"),
    (("config_groups", "group_0", "input_activations", "num_bits"), 4, "input_activations.num_bits is 4"),
    (("config_groups", "group_0", "weights", "num_bits"), 4, "weights.num_bits is 4"),
    (("config_groups", "group_0", "input_activations"), None, "no input_activations"),
])
def test_a_scheme_other_than_w8a8_is_refused_by_name(w8a8_pair, tmp_path, path, value, message):
    quantized, _ = w8a8_pair
    bad = rewrite_checkpoint(quantized, tmp_path / "bad", lambda t: None)
    config = json.loads((bad / "config.json").read_text())
    node = config["quantization_config"]
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        LLM(str(bad), dtype="float32", max_model_len=64, kv_cache_memory="8MiB")


@pytest.mark.parametrize("source", ["checkpoint", "online"])
def test_decoder_weights_are_held_in_one_byte(w8a8_pair, float_llama, source):
    options: dict[str, object] = dict(dtype="float32", max_model_len=64, kv_cache_memory="8MiB")
    llm = LLM(str(w8a8_pair[0]), **options) if source == "checkpoint" else \
        LLM(str(float_llama), quantization="int8", **options)
    dtypes, total = weight_storage(llm)
    _, float_total = weight_storage(LLM(str(float_llama), **options))
    assert {dtype for prefix, dtype in dtypes.items() if prefix != "lm_head"} == {torch.int8}, dtypes
    assert dtypes["lm_head"] == torch.float32
    rows = 64 + 32 + 32 + 64 + 128 + 128 + 64  # q, k, v, o, gate, up, down of the tiny Llama (hidden 64, MLP 128)
    decoder = 2 * (64 * (rows - 64) + 128 * 64)  # weight elements in its 2 layers (down_proj is 64 x 128)
    assert float_total - total == 3 * decoder - 2 * rows * 4  # 4 bytes became 1, plus a float32 scale a row
