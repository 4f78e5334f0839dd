"""A tiny random Gemma 3 written to GGUF the way llama.cpp's converter writes it (its tensor
names, norm weights stored as ``1 + w``, the sliding window, no rope of its own for the
sliding layers) loads back to the original config and parameters. The real Gemma-3-270m
file is checked end to end, against transformers, in tests/test_gemma3_gguf.py."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from test_gguf_loader import BOS_ID, EOS_ID, TINY_VOCAB, tiny_vocabulary
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from tokenmill_quant_gguf.loader import load_gguf_checkpoint
from tokenmill_quant_gguf.weights import dequantized_weights

# HF leaf -> llama.cpp leaf, written out independently of the loader's tables.
GEMMA3_LEAVES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm"}


def _llama_cpp_name(hf_name: str) -> str:
    stem, kind = hf_name.rsplit(".", 1)
    if stem in TOP:
        return f"{TOP[stem]}.{kind}"
    _, _, layer, leaf = stem.split(".", 3)
    return f"blk.{layer}.{GEMMA3_LEAVES[leaf]}.{kind}"


def _tiny_gemma3() -> Gemma3ForCausalLM:
    config = Gemma3TextConfig(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, max_position_embeddings=128, sliding_window=8,
        rms_norm_eps=1e-6, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
    )
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():  # norms start at zeros; make every value distinctive
            parameter.copy_(torch.randn_like(parameter))
    return model


def _write_gguf(model: Gemma3ForCausalLM, path: Path) -> None:
    config = model.config
    writer = gguf.GGUFWriter(path, "gemma3")
    writer.add_name("tiny-gemma3")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["full_attention"]["rope_theta"])
    writer.add_sliding_window(config.sliding_window)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    tokens, types, merges = tiny_vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight":
            continue  # tied: llama.cpp writes no output tensor
        values = tensor.numpy()
        if hf_name.endswith("norm.weight"):
            values = values + 1.0  # the converter stores Gemma's norms as the 1 + w they multiply by
        writer.add_tensor(_llama_cpp_name(hf_name), np.ascontiguousarray(values, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_tiny_gemma3_round_trip(tmp_path: Path) -> None:
    model = _tiny_gemma3()
    path = tmp_path / "tiny-gemma3.gguf"
    _write_gguf(model, path)

    checkpoint = load_gguf_checkpoint(path, torch.float32)

    config = checkpoint.hf_config
    assert config.model_type == "gemma3_text"
    assert checkpoint.architectures == ["Gemma3ForCausalLM"]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "query_pre_attn_scalar", "sliding_window", "layer_types",
                "rope_parameters", "tie_word_embeddings"):
        assert getattr(config, key) == getattr(model.config, key), key
    assert config.layer_types[5] == "full_attention" and config.layer_types[4] == "sliding_attention"

    original = model.state_dict()
    loaded = dict(dequantized_weights(checkpoint.weights()))
    assert set(loaded) == set(original) - {"lm_head.weight"}
    for name, tensor in loaded.items():
        # (1 + w) - 1 rounds in float32, as transformers' own GGUF loading does
        torch.testing.assert_close(tensor, original[name], rtol=0, atol=1e-6, msg=name)
