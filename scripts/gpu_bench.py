"""A short CUDA benchmark for scripts/gpu-check: tokenmill vs transformers on
one workload (random-weight Llama "100M": hidden 768, 12 layers, 12 heads,
4 KV heads, vocab 32000; 64 prompts of 128 random tokens, 128 output tokens,
greedy, ignore EOS). Prints total tokens/s for both and their ratio."""

from __future__ import annotations

import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 64, 128, 128


def build_model(folder: Path) -> None:
    from tiny_models import build_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                         num_key_value_heads=4, vocab_size=32000, max_position_embeddings=1024)
    LlamaForCausalLM(config).save_pretrained(folder)
    build_tokenizer(folder)


def bench_tokenmill(folder: Path, prompts: list[list[int]]) -> float:
    from tokenmill import LLM, SamplingParams

    llm = LLM(str(folder), dtype="bfloat16", max_model_len=512, max_num_seqs=NUM_PROMPTS,
              gpu_memory_utilization=0.5)
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    torch.cuda.synchronize()
    return NUM_PROMPTS * (INPUT_LEN + OUTPUT_LEN) / (time.perf_counter() - start)


def bench_transformers(folder: Path, prompts: list[list[int]]) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda()
    model.generation_config.eos_token_id = None
    batch = torch.tensor(prompts, device="cuda")
    model.generate(batch[:4], max_new_tokens=8, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(batch, max_new_tokens=OUTPUT_LEN, min_new_tokens=OUTPUT_LEN, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    return NUM_PROMPTS * (INPUT_LEN + OUTPUT_LEN) / (time.perf_counter() - start)


def main() -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 32000) for _ in range(INPUT_LEN)] for _ in range(NUM_PROMPTS)]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build_model(folder)
        ours = bench_tokenmill(folder, prompts)
        theirs = bench_transformers(folder, prompts)
    print(f"workload: {NUM_PROMPTS} prompts x {INPUT_LEN} in / {OUTPUT_LEN} out, bf16, {torch.cuda.get_device_name(0)}")
    print(f"tokenmill     total tok/s: {ours:,.0f}")
    print(f"transformers  total tok/s: {theirs:,.0f}  (one batch of {NUM_PROMPTS})")
    print(f"ratio: {ours / theirs:.2f}x")


if __name__ == "__main__":
    main()
