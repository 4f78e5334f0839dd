#!/usr/bin/env python3
"""One MoE layer's experts, the CPU platform's grouped paths against the reference loop (issue 17:
the grouped path should be >= 2x the loop at batch 64): the torch grouping (moe.py, sorted
pairs, one matmul per expert) and the C++ grouped kernel (kernels/grouped_moe.cpp, one call).

    python scripts/bench-moe-layer.py --hidden 512 --intermediate 1024 --experts 8 --top-k 2 --tokens 1 64 300

Random stacked expert weights and a random router (softmax, top-k, renormalised, as Mixtral);
each path runs on the same inputs, its output checked against the reference, and the median of
--repeats timed calls is printed per token count and dtype, with the kernel's ratio to the loop.
Threads: torch's default (set OMP_NUM_THREADS / TOKENMILL_NUM_THREADS to pin it). Run it on a
quiet machine; on a shared one, ``--clock cpu`` times the process's CPU time instead (meaningful
with one thread: a second one's spinning between regions would count too).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from tokenmill.layers.ops import NATIVE
from tokenmill_platform_cpu.kernels import load_kernels
from tokenmill_platform_cpu.moe import grouped_fused_moe


def median_ms(run: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], repeats: int,
              clock: Callable[[], float] = time.perf_counter) -> float:
    for _ in range(3):
        run(*inputs)
    times = []
    for _ in range(repeats):
        start = clock()
        run(*inputs)
        times.append(clock() - start)
    return 1000 * statistics.median(times)


def grouped_path(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                 ids: torch.Tensor) -> torch.Tensor:
    return grouped_fused_moe(x, w13, w2, weights, ids, NATIVE.silu_and_mul)


def routed(tokens: int, experts: int, top_k: int, hidden: int, dtype: torch.dtype,
           generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(tokens, hidden, generator=generator).to(dtype)
    logits = torch.randn(tokens, experts, generator=generator)
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    return x, (weights / weights.sum(-1, keepdim=True)).to(dtype), ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 300])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    kernels = load_kernels()
    if kernels is None:
        raise SystemExit("the CPU kernels did not build")
    print(f"{args.clock} time, threads {torch.get_num_threads()} (kernels {kernels.pool_threads()}), hidden {args.hidden}, intermediate {args.intermediate}, "
          f"{args.experts} experts, top-{args.top_k}")
    print(f"{'dtype':>9} {'tokens':>6} {'reference ms':>13} {'grouped ms':>11} {'kernel ms':>10} {'speed-up':>9}")
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        w13 = (torch.randn(args.experts, 2 * args.intermediate, args.hidden, generator=generator) * 0.05).to(dtype)
        w2 = (torch.randn(args.experts, args.hidden, args.intermediate, generator=generator) * 0.05).to(dtype)
        packed = kernels.pack_moe_experts(w13, w2)
        for tokens in args.tokens:
            x, weights, ids = routed(tokens, args.experts, args.top_k, args.hidden, dtype, generator)
            inputs = (x, w13, w2, weights, ids)
            reference = NATIVE.fused_moe(*inputs)
            tolerance = 1e-4 if dtype == torch.float32 else 5e-2
            packed_inputs = (*inputs, packed)  # the kernel with the experts packed at load, as the engine runs it
            for path, given in ((grouped_path, inputs), (kernels.grouped_moe, packed_inputs)):
                torch.testing.assert_close(path(*given).float(), reference.float(), rtol=tolerance, atol=tolerance)
            loop = median_ms(NATIVE.fused_moe, inputs, args.repeats, clock)
            grouped = median_ms(grouped_path, inputs, args.repeats, clock)
            kernel = median_ms(kernels.grouped_moe, packed_inputs, args.repeats, clock)
            print(f"{dtype_name:>9} {tokens:>6} {loop:>13.3f} {grouped:>11.3f} {kernel:>10.3f} {loop / kernel:>8.2f}x")


if __name__ == "__main__":
    main()
