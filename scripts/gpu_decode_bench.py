"""Decode speed on a CUDA GPU for scripts/gpu-check: a random-weight ~100M Llama (hidden 768,
12 layers, 12 heads, 4 KV heads, vocab 32000) in bfloat16.

- TPOT at batch 1 and 64: the time per output token after the first, from two runs of the
  same prompts (1 output token, then 1 + N): (t_long - t_short) / N.
- Throughput: 64 prompts x 128 random tokens in, 128 out (greedy, EOS ignored), total tokens/s.

Prints one line per number and writes them, with the attention backend the engine chose,
whether decode steps ran through CUDA graphs, and the GPU's name, to the JSON file --out names.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

INPUT_LEN, OUTPUT_LEN, THROUGHPUT_PROMPTS = 128, 128, 64


def _timed_generate(llm, prompts: list[list[int]], max_tokens: int) -> float:
    from tokenmill import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def tpot(llm, prompts: list[list[int]], new_tokens: int) -> float:
    """Seconds per output token after the first, for this batch of prompts."""
    _timed_generate(llm, prompts, 2)  # warm-up: graph capture of this batch size, allocator
    short = _timed_generate(llm, prompts, 1)
    long = _timed_generate(llm, prompts, 1 + new_tokens)
    return (long - short) / new_tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    from gpu_bench import build_model
    from worker_probe import attention_backend, graph_batch_sizes

    from tokenmill import LLM

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 32000) for _ in range(INPUT_LEN)] for _ in range(THROUGHPUT_PROMPTS)]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build_model(folder)
        llm = LLM(str(folder), dtype="bfloat16", max_model_len=512, max_num_seqs=THROUGHPUT_PROMPTS,
                  gpu_memory_utilization=0.5)
        results: dict[str, object] = {"gpu": torch.cuda.get_device_name(0), "model": "random Llama ~100M, bf16",
                                      "attention_backend": attention_backend(llm)}
        results["tpot_ms_batch1"] = tpot(llm, prompts[:1], OUTPUT_LEN) * 1000
        results["tpot_ms_batch64"] = tpot(llm, prompts, OUTPUT_LEN) * 1000
        _timed_generate(llm, prompts[:4], 4)
        seconds = _timed_generate(llm, prompts, OUTPUT_LEN)
        results["throughput_64x128_128_tok_s"] = THROUGHPUT_PROMPTS * (INPUT_LEN + OUTPUT_LEN) / seconds
        results["output_tok_s_64x128_128"] = THROUGHPUT_PROMPTS * OUTPUT_LEN / seconds
        results["cuda_graph_batch_sizes"] = graph_batch_sizes(llm)
    for key, value in results.items():
        print(f"{key}: {value:.2f}" if isinstance(value, float) else f"{key}: {value}")
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
