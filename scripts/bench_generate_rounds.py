"""Rounds of one batch through ``LLM.generate`` in one process, fresh random prompts each round
(so the prefix cache never hits), after a short warm-up: the seconds of each round. For A/B runs
of an engine change where a benchmark process's start-up and first-run costs would blur it.

    python scripts/bench_generate_rounds.py bench-models/100m                       # 64 x (128 + 128)
    python scripts/bench_generate_rounds.py bench-models/100m --max-tokens 1        # prefill only
    python scripts/bench_generate_rounds.py bench-models/100m --max-tokens 1 --kernel-max-seq-len 0

``--kernel-max-seq-len`` sets the CPU attention backend's KERNEL_MAX_SEQ_LEN (0: every prompt
through SDPA, as before the tenth session). Alternate the runs you compare; the output is for
reading, not asserting.
"""

from __future__ import annotations

import argparse
import random
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kernel-max-seq-len", type=int, default=None)
    args = parser.parse_args()
    if args.kernel_max_seq_len is not None:
        import tokenmill_platform_cpu.attention as cpu_attention

        cpu_attention.KERNEL_MAX_SEQ_LEN = args.kernel_max_seq_len
    from tokenmill import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.input_len + args.max_tokens + 16,
              max_num_seqs=args.prompts)
    rng = random.Random(0)

    def prompts() -> list[dict[str, list[int]]]:
        return [{"prompt_token_ids": [rng.randrange(100, 30000) for _ in range(args.input_len)]}
                for _ in range(args.prompts)]

    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, detokenize=False)
    llm.generate([{"prompt_token_ids": [5] * 16}], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    seconds = []
    for _ in range(args.rounds):
        batch = prompts()
        start = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
    print(f"{args.model}: {args.prompts} x ({args.input_len} + {args.max_tokens}) tokens, seconds per round:",
          " ".join(f"{s:.2f}" for s in seconds))


if __name__ == "__main__":
    main()
