"""Write a Llama checkpoint folder (safetensors, float32) as a GGUF file laid out the way
llama.cpp's converter writes Llama models, so llama.cpp can run the same weights as tokenmill
(scripts/bench-llama-cpp). Only what the benchmark models need: Llama, untied or tied
embeddings, a BPE tokenizer.json (its merges, or a placeholder where it has none: the benchmark
feeds token ids, never text).

``--type q8_0`` / ``q4_0`` packs every 2-d tensor (embedding and output included, as
``llama-quantize --pure`` does) with the gguf package's own quantizer; the norms stay F32.

    python scripts/hf_to_gguf.py bench-models/tiny /tmp/tiny-f32.gguf
    python scripts/hf_to_gguf.py bench-models/tiny /tmp/tiny-q4_0.gguf --type q4_0
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import gguf
import numpy as np
from gguf.quants import quantize
from safetensors.numpy import load_file

LAYER_LEAVES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                "mlp.down_proj": "ffn_down"}
TOP_LEVEL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
# --type: the ggml type of the 2-d tensors and the file type the header declares
TYPES = {"f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
         "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
         "q4_0": (gguf.GGMLQuantizationType.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0)}


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


def placeholder_merges(tokens: list[str]) -> list[str]:
    """Two merges for a vocabulary that has none (the benchmarks' one-token-per-character one).

    llama.cpp insists on some merges; transformers (tokenmill's GGUF tokenizer) on each merge's
    result being a token, spelled in the byte-level alphabet (ASCII letters are), and on two at
    least (gguf reads a one-element array back as its element). So the last two ids' texts
    become the results of merging four single ASCII letters of the vocabulary in pairs."""
    letters = [t for t in tokens[:-2] if len(t) == 1 and t.isascii() and t.isalpha()][:4]
    if len(letters) < 4:
        raise SystemExit("the vocabulary has no merges and too few ASCII letters to make placeholder ones")
    tokens[-2], tokens[-1] = letters[0] + letters[1], letters[2] + letters[3]
    return [f"{letters[0]} {letters[1]}", f"{letters[2]} {letters[3]}"]


def write_vocabulary(writer: gguf.GGUFWriter, folder: Path, config: dict) -> None:
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    tokens = [t for t, _ in sorted(tokenizer["model"]["vocab"].items(), key=lambda item: item[1])]
    added = {a["id"]: a["content"] for a in tokenizer.get("added_tokens", [])}
    for i, content in added.items():
        if i < len(tokens):
            tokens[i] = content
    tokens += [f"<|unused_{i}|>" for i in range(config["vocab_size"] - len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"].get("merges", [])]
    if not merges:
        merges = placeholder_merges(tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if i in added else gguf.TokenType.NORMAL
                            for i in range(len(tokens))])
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_add_bos_token(False)


def convert(folder: Path, out: Path, type_name: str = "f32") -> None:
    qtype, file_type = TYPES[type_name]
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
    writer.add_file_type(file_type)
    write_vocabulary(writer, folder, config)
    for hf_name, tensor in load_file(folder / "model.safetensors").items():
        values = tensor.astype(np.float32)
        if ".q_proj." in hf_name:
            values = interleave_rotary_halves(values, config["num_attention_heads"])
        elif ".k_proj." in hf_name:
            values = interleave_rotary_halves(values, config["num_key_value_heads"])
        values = np.ascontiguousarray(values)
        if qtype == gguf.GGMLQuantizationType.F32 or values.ndim != 2:
            writer.add_tensor(gguf_name(hf_name), values)
        else:
            writer.add_tensor(gguf_name(hf_name), quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="the Llama checkpoint folder")
    parser.add_argument("out", type=Path, help="the GGUF file to write")
    parser.add_argument("--type", choices=sorted(TYPES), default="f32", help="ggml type of the 2-d tensors")
    args = parser.parse_args()
    convert(args.folder, args.out, args.type)
