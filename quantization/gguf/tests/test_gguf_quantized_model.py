"""GGUF models run from their quantized blocks, against transformers on the same weights dequantised.

Tiny Llamas are written the way llama.cpp writes them (``test_gguf_loader``'s writer),
their linear weights packed by the gguf package's quantizer, and loaded with
``LLM(path)``, no flag. transformers then scores tokenmill's greedy completions on the
file's weights dequantised by the gguf package (teacher forcing, as
``quant_agreement`` does). Both sides compute with the same float32 weights; only the
summation order differs (the kernel adds block by block), so the chosen tokens agree
everywhere but at a near-tie and the chosen-token logprobs to about 1e-5: the bound
below, 1e-3, leaves room for a long sum but would catch one wrong block or scale.

The default model (SmolLM2, Q4_1 with a Q8_0 embedding) is checked the same way, and
its resident weight bytes are measured against the dequantised run's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from quant_agreement import agreement_with_transformers, greedy_with_logprobs
from test_gguf_loader import requires_smollm2, tiny_model, write_llama_cpp_gguf
from transformers import PreTrainedModel

from tokenmill import LLM
from tokenmill_quant_gguf import default_model
from tokenmill_quant_gguf.loader import load_gguf_checkpoint
from tokenmill_quant_gguf.weights import dequantized_weights

MIXES = {
    "Q4_0": lambda name: GGMLQuantizationType.Q4_0,
    "Q4_1": lambda name: GGMLQuantizationType.Q4_1,
    "Q8_0": lambda name: GGMLQuantizationType.Q8_0,
    # llama.cpp's mixes give attn_v a wider type: q/k/v then cannot share one block layout.
    "mixed": lambda name: GGMLQuantizationType.Q8_0 if "v_proj" in name else GGMLQuantizationType.Q4_0,
}
PROMPTS = [[5 + 13 * i + j for j in range(3 + i)] for i in range(8)]


def dequantised_reference(path: Path, folder: Path) -> Path:
    """A transformers checkpoint of the GGUF file's weights, dequantised by the gguf package."""
    from transformers import AutoModelForCausalLM

    checkpoint = load_gguf_checkpoint(path, torch.float32)
    model: PreTrainedModel = AutoModelForCausalLM.from_config(checkpoint.hf_config)
    missing, unexpected = model.load_state_dict(dict(dequantized_weights(checkpoint.weights())), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    model.save_pretrained(folder)
    return folder


def linear_forms(llm: LLM) -> dict[str, str]:
    """Each linear layer's and the embedding's prefix -> ``qweight <type>`` (``qweight <type>+<type>`` for
    a merged layer whose shards keep blocks of different types), ``weight <dtype>`` or ``tied``."""

    def look(worker: object) -> dict[str, str]:
        model = worker.runner.model  # type: ignore[attr-defined]
        forms = {}
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if method is None:
                continue
            qtype, weight = getattr(method, "qtype", None), getattr(module, "weight", None)
            qtypes = getattr(method, "qtypes", None) or ((qtype,) if qtype is not None else ())
            if qtypes:
                forms[module.prefix] = "qweight " + "+".join(t.name for t in qtypes)
            else:  # a float layer, or a head tied to the embedding (no weight of its own)
                forms[module.prefix] = f"weight {weight.dtype}" if weight is not None else "tied"
        return forms

    return llm.engine.core.executor.collective_rpc(look)[0]


def resident_weight_bytes(llm: LLM) -> int:
    """Bytes of the model's parameters and buffers, each storage counted once (a tied head shares one)."""

    def look(worker: object) -> int:
        model = worker.runner.model  # type: ignore[attr-defined]
        storages = {}
        for tensor in [*model.parameters(), *model.buffers()]:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    return llm.engine.core.executor.collective_rpc(look)[0]


@pytest.mark.parametrize(("mix", "tied"), [(mix, False) for mix in sorted(MIXES)] + [("Q8_0", True)])
def test_quantized_tiny_llama_generates_like_transformers_on_its_dequantised_weights(tmp_path: Path, mix: str,
                                                                                     tied: bool):
    path = tmp_path / f"tiny-{mix}.gguf"
    write_llama_cpp_gguf(tiny_model("llama", tied=tied), path, "llama", MIXES[mix])
    completions, logprobs = greedy_with_logprobs(path, PROMPTS, 12)
    agreement = agreement_with_transformers(dequantised_reference(path, tmp_path / "reference"), PROMPTS,
                                            completions, logprobs)
    assert agreement.fraction >= 0.95, agreement
    assert agreement.max_logprob_error < 1e-3, agreement


def test_layers_keep_their_blocks_even_where_their_shards_differ(tmp_path: Path):
    path = tmp_path / "tiny-mixed.gguf"
    write_llama_cpp_gguf(tiny_model("llama", tied=False), path, "llama", MIXES["mixed"])
    llm = LLM(str(path), dtype="float32", max_model_len=64, kv_cache_memory="8MiB")
    forms = linear_forms(llm)
    assert forms["model.layers.0.self_attn.qkv_proj"] == "qweight Q4_0+Q8_0"  # q/k one Q4_0 part, v a Q8_0 one
    assert forms["model.layers.0.self_attn.o_proj"] == "qweight Q4_0"
    assert forms["model.layers.1.mlp.gate_up_proj"] == "qweight Q4_0"
    assert forms["lm_head"] == "qweight Q4_0"
    assert forms["model.embed_tokens"] == "qweight Q4_0"  # the embedding's rows stay in blocks too


def test_the_dequantized_option_keeps_every_layer_float(tmp_path: Path):
    path = tmp_path / "tiny-q4_1.gguf"
    write_llama_cpp_gguf(tiny_model("llama", tied=False), path, "llama", MIXES["Q4_1"])
    llm = LLM(str(path), dtype="float32", max_model_len=64, kv_cache_memory="8MiB", quantization="gguf-dequantized")
    assert set(linear_forms(llm).values()) == {"weight torch.float32"}


def test_two_ranks_split_the_blocks_and_match_one_rank(tmp_path: Path):
    # Intermediate 128: down_proj's input splits into 64 values a rank, two whole Q4_0 blocks.
    path = tmp_path / "tiny-tp.gguf"
    write_llama_cpp_gguf(tiny_model("llama", tied=True, intermediate_size=128), path, "llama", MIXES["Q4_0"])
    one = greedy_with_logprobs(path, PROMPTS[:4], 8)
    two = greedy_with_logprobs(path, PROMPTS[:4], 8, tensor_parallel_size=2)
    assert two[0] == one[0]
    assert max(abs(a - b) for ours, theirs in zip(one[1], two[1], strict=True)
               for a, b in zip(ours, theirs, strict=True)) < 1e-4


def test_a_rank_split_inside_a_block_is_refused_at_load(tmp_path: Path):
    # Intermediate 96 over two ranks: 48 values of down_proj's input each, not whole 32-value blocks.
    path = tmp_path / "tiny-tp.gguf"
    write_llama_cpp_gguf(tiny_model("llama", tied=True), path, "llama", MIXES["Q8_0"])
    with pytest.raises(Exception, match="48 input features per rank split Q8_0 blocks of 32 values"):
        LLM(str(path), dtype="float32", max_model_len=64, kv_cache_memory="8MiB", tensor_parallel_size=2)


@pytest.mark.slow
@requires_smollm2
def test_smollm2_runs_from_its_q4_1_blocks_like_transformers_on_the_dequantised_weights(tmp_path: Path):
    path = default_model.smollm2_gguf_path()
    completions, logprobs = greedy_with_logprobs(path, PROMPTS, 16)
    agreement = agreement_with_transformers(dequantised_reference(path, tmp_path / "reference"), PROMPTS,
                                            completions, logprobs)
    assert agreement.fraction >= 0.95, agreement
    assert agreement.max_logprob_error < 1e-3, agreement


@pytest.mark.slow
@requires_smollm2
def test_smollm2_weights_take_under_30_percent_of_their_float32_size():
    llm = LLM(dtype="float32", max_model_len=256, kv_cache_memory="16MiB")
    forms = linear_forms(llm)
    assert forms["model.embed_tokens"] == "qweight Q8_0"
    assert forms["lm_head"] == "tied"  # multiplies by the embedding's Q8_0 blocks
    assert forms["model.layers.0.self_attn.qkv_proj"] == forms["model.layers.29.mlp.gate_up_proj"] == "qweight Q4_1"
    config = llm.engine.core.checkpoint.hf_config
    float32_bytes = 4 * _parameter_count(config)
    assert resident_weight_bytes(llm) <= 0.30 * float32_bytes


def _parameter_count(config: object) -> int:
    """The float model's parameters (its tied head counted once), from a meta-device transformers model."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())
