#!/usr/bin/env python3
"""Time the Triton fused MoE's tile configs on this GPU and write the fastest per token count
into its table (tokenmill_platform_cuda/fused_moe_configs.json, or --table).

One layer shape per run, keyed as the kernel looks it up: experts, hidden, one expert's
intermediate size (per rank under tensor parallelism), the weights' dtype and this GPU's
name. For each token count every candidate (fused_moe_configs.candidate_configs) runs the
whole fused MoE (both launches and the alignment) under triton.testing.do_bench; candidates
that fail to compile or run out of shared memory are skipped. Entries of other shapes in the
table are kept.

    python scripts/tune-fused-moe.py --experts 8 --hidden 4096 --intermediate 14336 --top-k 2 --dtype bfloat16
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import triton.testing

from tokenmill_platform_cuda.fused_moe_configs import (
    TABLE_PATH,
    TileConfig,
    candidate_configs,
    fastest,
    read_table,
    table_key,
    with_entry,
    write_table,
)
from tokenmill_platform_cuda.fused_moe_triton import quantize_per_row, triton_fused_moe, triton_fused_moe_quantized

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float8_e4m3fn": torch.float8_e4m3fn,
          "int8": torch.int8}
DEFAULT_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, required=True)
    parser.add_argument("--hidden", type=int, required=True)
    parser.add_argument("--intermediate", type=int, required=True, help="one expert's (per rank under TP)")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="the experts' weights")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULT_TOKENS))
    parser.add_argument("--table", type=Path, default=TABLE_PATH)
    parser.add_argument("--sample", type=int, default=0,
                        help="time only this many candidates, spread over the list (a smoke run)")
    return parser


def _runner(args: argparse.Namespace, tokens: int):
    """A callable ``config -> output`` running the layer at ``tokens`` rows on random inputs."""
    device, dtype = torch.device("cuda"), DTYPES[args.dtype]
    experts, hidden, inter = args.experts, args.hidden, args.intermediate
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    w13 = torch.randn(experts, 2 * inter, hidden, device=device, dtype=torch.bfloat16) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, device=device, dtype=torch.bfloat16) / inter**0.5
    logits = torch.randn(tokens, experts, device=device)
    weights, ids = torch.topk(torch.softmax(logits, -1), args.top_k, -1)
    if dtype in (torch.bfloat16, torch.float16):
        x, w13, w2 = x.to(dtype), w13.to(dtype), w2.to(dtype)
        return lambda config: triton_fused_moe(x, w13, w2, weights, ids, config=config)
    q13, s13 = (torch.stack(parts) for parts in zip(*(quantize_per_row(w, dtype) for w in w13), strict=True))
    q2, s2 = (torch.stack(parts) for parts in zip(*(quantize_per_row(w, dtype) for w in w2), strict=True))
    return lambda config: triton_fused_moe_quantized(x, q13, s13, q2, s2, weights, ids, config=config)


def _time_candidates(run, sample: int) -> dict[TileConfig, float]:
    candidates = candidate_configs()
    if sample:
        candidates = candidates[::max(1, len(candidates) // sample)][:sample]
    timings: dict[TileConfig, float] = {}
    for config in candidates:
        try:
            run(config)  # compile outside the timing
            timings[config] = float(triton.testing.do_bench(lambda config=config: run(config), warmup=5, rep=25))
        except Exception as error:  # out of shared memory, a tile the compiler refuses: skip it
            print(f"  skip {config}: {type(error).__name__}")
    return timings


def main() -> None:
    args = _parser().parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tune-fused-moe: needs a CUDA GPU")
    key = table_key(args.experts, args.hidden, args.intermediate, args.dtype, torch.cuda.get_device_name())
    table = read_table(args.table)
    for tokens in args.tokens:
        timings = _time_candidates(_runner(args, tokens), args.sample)
        best = fastest(timings)
        print(f"{key} tokens={tokens}: {best} {timings[best] * 1000:.1f} us ({len(timings)} configs ran)")
        table = with_entry(table, key, tokens, best)
        write_table(table, args.table)  # after each bucket: an interrupted run keeps what it measured


if __name__ == "__main__":
    main()
