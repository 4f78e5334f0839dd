"""llama.cpp (llama-cpp-python) at batch 1, the workload of `tokenmill bench latency
--batch-size 1 --input-len 128 --output-len 128`: random prompt token ids, each output token
sampled at temperature 1 (no top-k / top-p / min-p), two threads. Prints TTFT, TPOT and output
tok/s, averaged over the runs after one warm-up. Run by scripts/bench-llama-cpp.

    python scripts/llama_cpp_batch1.py MODEL.gguf [--runs 3] [--input-len 128] [--output-len 128]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from llama_cpp import Llama

SAMPLING = {"temp": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}


def one_request(llm: Llama, prompt: list[int], output_len: int) -> tuple[float, float]:
    """(TTFT, end-to-end) seconds of one request."""
    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt)
    token = llm.sample(**SAMPLING)
    first = time.perf_counter()
    for _ in range(output_len - 1):
        llm.eval([token])
        token = llm.sample(**SAMPLING)
    return first - start, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    llm = Llama(model_path=args.model, n_ctx=args.input_len + args.output_len, n_batch=args.input_len,
                n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
    rng = random.Random(0)
    vocab = llm.n_vocab()
    prompts = [[rng.randrange(3, vocab) for _ in range(args.input_len)] for _ in range(args.runs + 1)]
    one_request(llm, prompts[0], args.output_len)  # warm-up
    runs = [one_request(llm, prompt, args.output_len) for prompt in prompts[1:]]
    tpots = [(e2e - ttft) / (args.output_len - 1) for ttft, e2e in runs]
    print(f"llama.cpp batch 1: TTFT {statistics.mean(t for t, _ in runs) * 1e3:.1f} ms, "
          f"TPOT {statistics.mean(tpots) * 1e3:.2f} ms (runs {', '.join(f'{t * 1e3:.2f}' for t in tpots)}), "
          f"output {statistics.mean(args.output_len / e2e for _, e2e in runs):.1f} tok/s")


if __name__ == "__main__":
    main()
