#!/usr/bin/env python3
"""A random-weight Mixtral for MoE benchmarks (issue 17: hidden 512, 8 experts, top-2), with the
tokenizer of an existing model folder, saved as a Hugging Face folder (safetensors).

    python scripts/make-random-mixtral.py --tokenizer-from /tmp/bm/tiny /tmp/bm/mixtral
    tokenmill bench throughput --model /tmp/bm/mixtral --backend hf --hf-batch-size 64 ...
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
import transformers

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output", type=Path)
    parser.add_argument("--tokenizer-from", type=Path, required=True)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    args = parser.parse_args()
    source = transformers.AutoConfig.from_pretrained(args.tokenizer_from)
    config = transformers.MixtralConfig(
        vocab_size=source.vocab_size, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4, head_dim=args.hidden // 8,
        num_local_experts=args.experts, num_experts_per_tok=args.top_k, max_position_embeddings=2048,
        bos_token_id=source.bos_token_id, eos_token_id=source.eos_token_id, pad_token_id=source.pad_token_id)
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(config).to(torch.float32).save_pretrained(args.output)
    for name in TOKENIZER_FILES:
        if (args.tokenizer_from / name).exists():
            shutil.copy(args.tokenizer_from / name, args.output / name)
    print(args.output)


if __name__ == "__main__":
    main()
