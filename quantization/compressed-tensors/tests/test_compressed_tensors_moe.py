"""compressed-tensors MoE checkpoints: FP8 experts (``FP8_DYNAMIC``, the package's own
compressor writing each expert's float8 ``weight`` and per-channel ``weight_scale``) run
through the fp8 plugin's serialized experts; a tiny Mixtral agrees with transformers on its
decompressed twin (activations rounded per token, scored as the FP8 tests score it). A
scheme whose experts are not read yet is refused naming its group."""

from __future__ import annotations

import random

import pytest
from compressed_tensors_models import build_compressed_pair, preset
from gptq_models import EXPERTS, LINEAR
from moe_models import build_moe_model
from quant_agreement import agreement_with_transformers, greedy_with_logprobs

from tokenmill import LLM
from tokenmill.layers import FusedMoE


def _expert_methods(worker) -> set[str]:
    return {type(m.quant_method).__name__ for m in worker.runner.model.modules() if isinstance(m, FusedMoE)}


def test_fp8_dynamic_moe_checkpoint_agrees_with_transformers_on_decompressed_weights(tmp_path):
    float_folder = build_moe_model(tmp_path / "float", "mixtral")
    quantized, dequantized = tmp_path / "ct", tmp_path / "dequantized"
    build_compressed_pair(float_folder, quantized, dequantized, preset("FP8_DYNAMIC"), "float-quantized",
                          linear=LINEAR + EXPERTS)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 380) for _ in range(n)] for n in (5, 9, 17, 23, 31, 40, 47, 60)]
    tokens, logprobs = greedy_with_logprobs(quantized, prompts, 12)
    agreement = agreement_with_transformers(dequantized, prompts, tokens, logprobs)
    assert agreement.fraction >= 0.95, agreement
    llm = LLM(str(quantized), dtype="float32", max_model_len=64, kv_cache_memory="8MiB")
    assert llm.engine.core.executor.collective_rpc(_expert_methods)[0] == {"Fp8SerializedMoEMethod"}


def test_a_scheme_whose_experts_are_not_read_is_refused_naming_its_group(tmp_path):
    float_folder = build_moe_model(tmp_path / "float", "mixtral")
    quantized, dequantized = tmp_path / "ct", tmp_path / "dequantized"
    build_compressed_pair(float_folder, quantized, dequantized, preset("W4A16", group_size=32), "pack-quantized",
                          linear=LINEAR + EXPERTS)
    with pytest.raises(ValueError, match=r"group_0.*MoE layer model\.layers\.0\.block_sparse_moe\.experts"):
        LLM(str(quantized), dtype="float32", max_model_len=64, kv_cache_memory="8MiB")
