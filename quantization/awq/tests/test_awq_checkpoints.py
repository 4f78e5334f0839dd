"""AWQ checkpoints end to end: written in AutoAWQ's GEMM layout (tests/awq_models.py),
loaded by ``LLM(path)`` with no flag, generating what transformers generates on the
dequantised weights. Weight-only, as GPTQ: the tolerance is the GPTQ test's (float32
summation order only; see quantization/gptq/tests/test_gptq_checkpoints.py)."""

from __future__ import annotations

import json
import random
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
from awq_models import AWQ_ORDER, build_awq_pair
from quant_agreement import agreement_with_transformers, greedy_with_logprobs, rewrite_checkpoint
from safetensors import safe_open
from tiny_models import build_model

from tokenmill import LLM
from tokenmill_quant_awq.method import awq_to_natural
from tokenmill_quant_gptq.kernels import unpack_columns

MAX_NEW = 16
LOGPROB_TOLERANCE = 1e-3


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, 380) for _ in range(n)] for n in (3, 8, 12, 19, 25, 33, 41, 55)]


def _options() -> dict[str, object]:
    return dict(dtype="float32", max_model_len=64, kv_cache_memory="8MiB")


@pytest.fixture(scope="module")
def float_llama(tmp_path_factory) -> Path:
    assert any(ep.name == "awq" for ep in entry_points(group="tokenmill.plugins")), \
        "plugin 'awq' is not installed: pip install -e quantization/awq"
    return build_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module", params=[32, 64])
def awq_pair(request, float_llama, tmp_path_factory) -> tuple[Path, Path, int]:
    quantized, dequantized = tmp_path_factory.mktemp("awq"), tmp_path_factory.mktemp("dequantized")
    build_awq_pair(float_llama, quantized, dequantized, request.param)
    return quantized, dequantized, request.param


@pytest.mark.parametrize("backend", ["sdpa", "cpu-paged"])
def test_awq_checkpoint_generates_like_transformers_on_dequantised_weights(awq_pair, backend):
    quantized, dequantized, _ = awq_pair
    prompts = _prompts()
    tokens, logprobs = greedy_with_logprobs(quantized, prompts, MAX_NEW, attention_backend=backend)
    agreement = agreement_with_transformers(dequantized, prompts, tokens, logprobs)
    assert agreement.fraction >= 0.95, agreement
    assert agreement.max_logprob_error <= LOGPROB_TOLERANCE, agreement


def test_the_checkpoint_reads_back_in_awq_order(awq_pair, float_llama):
    """Nibble ``i`` of word ``[k, c]`` is column ``8c + AWQ_ORDER[i]``: unpacked by hand, the
    file gives back the twin's weight, within half a step of the original."""
    quantized, dequantized, group = awq_pair
    prefix = "model.layers.1.mlp.down_proj"
    with safe_open(str(quantized / "model.safetensors"), "pt") as f:
        qweight, qzeros, scales = (f.get_tensor(f"{prefix}.{n}") for n in ("qweight", "qzeros", "scales"))
    with safe_open(str(float_llama / "model.safetensors"), "pt") as f:
        original = f.get_tensor(f"{prefix}.weight")
    n, k = original.shape
    assert qweight.shape == (k, n // 8) and qzeros.shape == (k // group, n // 8) and scales.shape == (k // group, n)

    def by_hand(words: torch.Tensor) -> torch.Tensor:
        out = torch.empty(words.shape[0], words.shape[1] * 8, dtype=torch.int32)
        for nibble, column in enumerate(AWQ_ORDER):
            out[:, column::8] = (words >> (4 * nibble)) & 15
        return out

    g = torch.arange(k) // group
    ours = ((by_hand(qweight) - by_hand(qzeros)[g]).float() * scales[g].float()).t()
    with safe_open(str(dequantized / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor(f"{prefix}.weight"), ours)
    assert ((ours - original).abs() <= scales[g].float().t() / 2 + 1e-6).all()
    assert torch.equal(unpack_columns(awq_to_natural(qweight), 4), by_hand(qweight))  # the plugin's reorder


def test_an_input_that_does_not_divide_into_groups_is_refused_at_load(awq_pair, tmp_path):
    quantized, _, _ = awq_pair
    bad = rewrite_checkpoint(quantized, tmp_path / "bad", lambda t: None)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["group_size"] = 48
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="64 input features do not divide into AWQ groups of 48"):
        LLM(str(bad), **_options())


@pytest.mark.parametrize(("changes", "message"), [
    ({"version": "gemv"}, "version 'gemv'"),
    ({"bits": 8}, "bits=8"),
    ({"zero_point": False}, "zero_point=false"),
])
def test_other_awq_layouts_are_refused_by_name(awq_pair, tmp_path, changes, message):
    bad = rewrite_checkpoint(awq_pair[0], tmp_path / "bad", lambda t: None)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"].update(changes)
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        LLM(str(bad), **_options())


def test_a_qweight_of_the_wrong_width_is_refused(awq_pair, tmp_path):
    name = "model.layers.0.self_attn.k_proj.qweight"
    bad = rewrite_checkpoint(awq_pair[0], tmp_path / "bad", lambda t: t.__setitem__(name, t[name][:, :2].contiguous()))
    with pytest.raises(ValueError, match=r"qkv_proj\.qweight: shape \(64, 2\) for shard 1"):
        LLM(str(bad), **_options())
