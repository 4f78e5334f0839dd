"""Write a Llama checkpoint folder (safetensors, float32) as a GGUF F32 file laid out the way
llama.cpp's converter writes Llama models, so llama.cpp can run the same weights as tokenmill
(scripts/bench-llama-cpp). Only what the benchmark models need: Llama, untied or tied
embeddings, a BPE tokenizer.json (its merges, or a placeholder where it has none: the benchmark
feeds token ids, never text).

    python scripts/hf_to_gguf.py bench-models/tiny /tmp/tiny-f32.gguf
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

LAYER_LEAVES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                "mlp.down_proj": "ffn_down"}
TOP_LEVEL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf_name: str) -> str:
    stem, kind = hf_name.rsplit(".", 1)
    if stem in TOP_LEVEL:
        return f"{TOP_LEVEL[stem]}.{kind}"
    _, _, layer, leaf = stem.split(".", 3)
    return f"blk.{layer}.{LAYER_LEAVES[leaf]}.{kind}"


def interleave_rotary_halves(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's Llama rotates interleaved pairs where transformers rotates halves."""
    return weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2) \
        .reshape(weight.shape)


def write_vocabulary(writer: gguf.GGUFWriter, folder: Path, config: dict) -> None:
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    tokens = [t for t, _ in sorted(tokenizer["model"]["vocab"].items(), key=lambda item: item[1])]
    added = {a["id"]: a["content"] for a in tokenizer.get("added_tokens", [])}
    for i, content in added.items():
        if i < len(tokens):
            tokens[i] = content
    tokens += [f"<|unused_{i}|>" for i in range(config["vocab_size"] - len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"].get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if i in added else gguf.TokenType.NORMAL
                            for i in range(len(tokens))])
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_merges(merges or [f"{tokens[-2]} {tokens[-1]}"])  # llama.cpp insists on some
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_add_bos_token(False)


def convert(folder: Path, out: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type") != "llama":
        raise SystemExit(f"{folder}: only Llama checkpoints, not {config.get('model_type')!r}")
    writer = gguf.GGUFWriter(out, "llama")
    writer.add_name(folder.name)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    write_vocabulary(writer, folder, config)
    for hf_name, tensor in load_file(folder / "model.safetensors").items():
        values = tensor.astype(np.float32)
        if ".q_proj." in hf_name:
            values = interleave_rotary_halves(values, config["num_attention_heads"])
        elif ".k_proj." in hf_name:
            values = interleave_rotary_halves(values, config["num_key_value_heads"])
        writer.add_tensor(gguf_name(hf_name), np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    convert(Path(sys.argv[1]), Path(sys.argv[2]))
