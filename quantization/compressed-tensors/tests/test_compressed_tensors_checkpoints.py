"""compressed-tensors checkpoints end to end: written by the ``compressed-tensors`` package's own
compressors (tests/compressed_tensors_models.py), loaded by ``LLM(path)`` with no flag, each
config group run by the kernels the dispatcher hands it to, scored against transformers on
the package's own decompressed weights (teacher forcing, tests/quant_agreement.py).

Tolerances, by what the kernels compute beyond the dequantised weights: weight-only
(W4A16, W8A16) nothing, so float32 summation order only, 1e-3 as the GPTQ tests;
INT8 W8A8 and FP8 also round every activation row, bounded as in their own plugins'
tests (0.10 and 0.35 nat: quantization/int8/tests/test_w8a8_checkpoints.py,
quantization/fp8/tests/test_fp8_checkpoints.py).
"""

from __future__ import annotations

import json
import random
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
from compressed_tensors_models import build_compressed_pair, preset
from quant_agreement import agreement_with_transformers, greedy_with_logprobs, rewrite_checkpoint, weight_storage
from tiny_models import build_model

from tokenmill import LLM
from tokenmill.layers import VocabEmbedding

MAX_NEW = 16
CASES = {  # name: (preset, weight overrides, format, the weight dtype tokenmill keeps, logprob tolerance)
    "W4A16-group32": ("W4A16", {"group_size": 32}, "pack-quantized", torch.int32, 1e-3),
    "W4A16_ASYM-channel": ("W4A16_ASYM", {"strategy": "channel", "group_size": None}, "pack-quantized",
                           torch.int32, 1e-3),
    "W8A16_ASYM-group64": ("W8A16", {"group_size": 64, "symmetric": False}, "pack-quantized", torch.int32, 1e-3),
    "W8A8": ("W8A8", {}, "int-quantized", torch.int8, 0.10),
    "FP8_DYNAMIC": ("FP8_DYNAMIC", {}, "float-quantized", torch.float8_e4m3fn, 0.35),
}


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 380) for _ in range(n)] for n in (3, 8, 12, 19, 25, 33, 41, 55)]


def _options() -> dict[str, object]:
    return dict(dtype="float32", max_model_len=64, kv_cache_memory="8MiB")


@pytest.fixture(scope="module")
def float_llama(tmp_path_factory) -> Path:
    assert any(ep.name == "compressed_tensors" for ep in entry_points(group="tokenmill.plugins")), \
        "plugin 'compressed_tensors' is not installed: pip install -e quantization/compressed-tensors"
    return build_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def pairs(float_llama, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    built = {}
    for name, (scheme, overrides, fmt, _, _) in CASES.items():
        quantized, dequantized = tmp_path_factory.mktemp("ct"), tmp_path_factory.mktemp("dequantized")
        build_compressed_pair(float_llama, quantized, dequantized, preset(scheme, **overrides), fmt)
        built[name] = quantized, dequantized
    return built


@pytest.mark.parametrize("case", CASES)
def test_each_scheme_generates_like_transformers_on_the_decompressed_weights(pairs, case):
    quantized, dequantized = pairs[case]
    prompts = _prompts()
    tokens, logprobs = greedy_with_logprobs(quantized, prompts, MAX_NEW)
    agreement = agreement_with_transformers(dequantized, prompts, tokens, logprobs)
    assert agreement.fraction >= 0.95, agreement
    assert agreement.max_logprob_error <= CASES[case][4], agreement


@pytest.mark.parametrize("case", CASES)
def test_each_scheme_keeps_its_weights_quantized(pairs, float_llama, case):
    llm = LLM(str(pairs[case][0]), **_options())
    assert weight_storage(llm)[1] < weight_storage(LLM(str(float_llama), **_options()))[1]
    kept = llm.engine.core.executor.collective_rpc(lambda w: {
        m.prefix: (type(m.quant_method).__name__, next(p.dtype for n, p in m.named_parameters()
                                                      if n in ("weight", "weight_packed")))
        for m in w.runner.model.modules() if hasattr(m, "quant_method") and not isinstance(m, VocabEmbedding)})[0]
    assert kept["lm_head"] == ("UnquantizedLinearMethod", torch.float32)  # ignore: ["lm_head"]
    assert {dtype for prefix, (_, dtype) in kept.items() if prefix != "lm_head"} == {CASES[case][3]}, kept


def _edit_config(source: Path, target: Path, edit) -> Path:
    bad = rewrite_checkpoint(source, target, lambda t: None)
    config = json.loads((bad / "config.json").read_text())
    edit(config["quantization_config"])
    (bad / "config.json").write_text(json.dumps(config))
    return bad


@pytest.mark.parametrize(("case", "edit", "message"), [
    ("W4A16-group32", lambda c: c.__setitem__("format", "int-quantized"),
     "'group_0' has no input_activations .* in format 'int-quantized'"),
    ("FP8_DYNAMIC", lambda c: c["config_groups"]["group_0"]["weights"].update(strategy="block",
                                                                              block_structure=[128, 128]),
     "weights.strategy is 'block'"),
    ("W8A8", lambda c: c["config_groups"]["group_0"]["input_activations"].__setitem__("symmetric", False),
     "input_activations.symmetric is False"),
    ("W4A16-group32", lambda c: c.__setitem__("quantization_status", "frozen"), "quantization_status 'frozen'"),
    ("W4A16-group32", lambda c: c.__setitem__("kv_cache_scheme", {"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
])
def test_a_scheme_no_kernel_runs_is_refused_naming_group_and_field(pairs, tmp_path, case, edit, message):
    bad = _edit_config(pairs[case][0], tmp_path / "bad", edit)
    with pytest.raises(ValueError, match=message):
        LLM(str(bad), **_options())


def test_a_merged_layer_split_across_groups_is_refused(pairs, tmp_path):
    bad = _edit_config(pairs["W8A8"][0], tmp_path / "bad",
                       lambda c: c["ignore"].append("model.layers.0.self_attn.k_proj"))
    with pytest.raises(ValueError, match=r"qkv_proj: its projections fall in different compressed-tensors groups "
                                         r"\(.*q_proj: group_0, .*k_proj: float"):
        LLM(str(bad), **_options())


def test_an_ignore_regex_makes_the_layers_it_matches_float(pairs, tmp_path):
    bad = _edit_config(pairs["W4A16-group32"][0], tmp_path / "partly",
                       lambda c: c["ignore"].append("re:.*layers\\.1\\.mlp\\..*"))
    # the checkpoint still holds packed tensors for layer 1's MLP, which the ignore made float layers
    with pytest.raises(KeyError, match=r"layers\.1\.mlp\.\w+\.weight_packed' has no parameter"):
        LLM(str(bad), **_options())


def test_a_weight_shape_that_disagrees_with_the_layer_is_refused(pairs, tmp_path):
    name = "model.layers.0.mlp.down_proj.weight_shape"
    bad = rewrite_checkpoint(pairs["W4A16-group32"][0], tmp_path / "bad",
                             lambda t: t.__setitem__(name, torch.tensor([64, 120])))
    with pytest.raises(ValueError, match=r"down_proj\.weight_shape: the checkpoint's weight is \[64, 120\]"):
        LLM(str(bad), **_options())
