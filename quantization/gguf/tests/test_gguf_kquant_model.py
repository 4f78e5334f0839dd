"""Tiny Llamas in llama.cpp's K-quants run from their blocks, against transformers on the same
weights dequantised (the measure and bound of ``test_gguf_quantized_model``).

The K-quants' 256-value super-blocks need every input dimension to be a multiple of
256: hidden 256 (4 heads of 64), intermediate 512. The blocks are packed by the tests'
``k_quantizer`` (the gguf package can unpack K-quants but not pack them; how its
packing is checked is said there). ``Q4_K_M`` is llama.cpp's most used mix: Q6_K for
``attn_v``, ``ffn_down`` and the output, Q4_K elsewhere; its q/k/v layer keeps both
types' blocks (one kernel call per type), so every layer stays quantized.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGMLQuantizationType
from quant_agreement import agreement_with_transformers, greedy_with_logprobs
from test_gguf_loader import tiny_model, write_llama_cpp_gguf
from test_gguf_quantized_model import (
    PROMPTS,
    _parameter_count,
    dequantised_reference,
    linear_forms,
    resident_weight_bytes,
)

from tokenmill import LLM

Q4_K, Q5_K, Q6_K = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K
MIXES = {
    "Q4_K": lambda name: Q4_K,
    "Q5_K": lambda name: Q5_K,
    "Q6_K": lambda name: Q6_K,
    "Q4_K_M": lambda name: Q6_K if any(part in name for part in ("v_proj", "down_proj", "lm_head")) else Q4_K,
}


def k_quant_llama(path: Path, mix: str, tied: bool = False) -> Path:
    model = tiny_model("llama", tied=tied, intermediate_size=512, hidden_size=256, head_dim=64)
    write_llama_cpp_gguf(model, path, "llama", MIXES[mix])
    return path


@pytest.mark.parametrize(("mix", "tied"), [("Q4_K", False), ("Q5_K", False), ("Q6_K", True), ("Q4_K_M", False)])
def test_k_quant_tiny_llama_generates_like_transformers_on_its_dequantised_weights(tmp_path: Path, mix: str,
                                                                                   tied: bool):
    path = k_quant_llama(tmp_path / f"tiny-{mix}.gguf", mix, tied)
    completions, logprobs = greedy_with_logprobs(path, PROMPTS, 12)
    agreement = agreement_with_transformers(dequantised_reference(path, tmp_path / "reference"), PROMPTS,
                                            completions, logprobs)
    assert agreement.fraction >= 0.95, agreement
    assert agreement.max_logprob_error < 1e-3, agreement


def test_q4_k_m_layers_keep_their_k_quant_blocks(tmp_path: Path):
    llm = LLM(str(k_quant_llama(tmp_path / "tiny-q4_k_m.gguf", "Q4_K_M")), dtype="float32", max_model_len=64,
              kv_cache_memory="8MiB")
    forms = linear_forms(llm)
    assert forms["model.layers.0.self_attn.qkv_proj"] == "qweight Q4_K+Q6_K"  # Q4_K q/k, Q6_K v
    assert forms["model.layers.0.self_attn.o_proj"] == "qweight Q4_K"
    assert forms["model.layers.1.mlp.gate_up_proj"] == "qweight Q4_K"
    assert forms["model.layers.1.mlp.down_proj"] == "qweight Q6_K"
    assert forms["lm_head"] == "qweight Q6_K"
    assert forms["model.embed_tokens"] == "qweight Q4_K"
    assert all(form.startswith("qweight") for form in forms.values())
    # Mostly Q4_K (14% of float32), some Q6_K (21%), plus the float norms: 17% here, against 54%
    # with the q/k/v layers dequantised.
    float32_bytes = 4 * _parameter_count(llm.engine.core.checkpoint.hf_config)
    assert resident_weight_bytes(llm) <= 0.20 * float32_bytes


@pytest.mark.parametrize(("mix", "bound"), [("Q4_K", 0.20), ("Q6_K", 0.25)])
def test_k_quant_weights_stay_quantized_in_memory(tmp_path: Path, mix: str, bound: float):
    # 4.5 and 6.56 bits a value against float32's 32 (14% and 21%), plus the float norms.
    llm = LLM(str(k_quant_llama(tmp_path / f"tiny-{mix}.gguf", mix)), dtype="float32", max_model_len=64,
              kv_cache_memory="8MiB")
    assert set(linear_forms(llm).values()) == {f"qweight {mix}"}
    float32_bytes = 4 * _parameter_count(llm.engine.core.checkpoint.hf_config)
    assert resident_weight_bytes(llm) <= bound * float32_bytes
