"""A decode or prefill step's worth of linear layers, bfloat16 against int8 W8A8, with the weights
coming from memory as a step reads them (a micro-benchmark, not a test; run it on a quiet machine).

``bench_int8_linear.py`` times one layer over and over, so its weight stays in the cache; a
step reads each of its layers once, and the tiny Llama's 25 MB of int8 weights, let alone the
100m's, do not stay cached between steps that also stream the KV cache and the lm_head. Here
every layer of the model (its q/k/v, o, gate/up and down shapes, repeated per decoder layer)
gets its own random weight, and each timed pass calls them all in turn:

* ``bf16``: the CPU platform's linear op on the bfloat16 weight, with the packed copy the engine
  prepares for it (``CpuLayerOps.prepare_linear_weight``): what a bfloat16 model runs;
* ``int8 packed``: the int8 kernel over the panels a loaded layer keeps (``w8a8_linear_packed``):
  what an int8 W8A8 model runs;
* ``int8 row-major``: the same kernel on the row-major weight with ``auto`` (tiles below 8 rows,
  panels packed per call from there on): what an int8 model ran before its layers kept panels.

Each int8 result is checked equal to the torch path on the first layer first. Times are the
median of ``--reps`` passes, the three cases interleaved.

    python scripts/bench_int8_step_layers.py --model tiny --rows 1,64
    python scripts/bench_int8_step_layers.py --model 100m --rows 64,2048 --reps 6
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from tokenmill_quant_int8.kernels import (
    cpu_kernel_runs,
    quantize_weight_per_channel,
    w8a8_linear_cpu,
    w8a8_linear_packed_cpu,
    w8a8_linear_torch,
    w8a8_pack_panels_cpu,
)

# (N outputs, K inputs) of one decoder layer's projections, and the decoder layers
MODELS = {
    "tiny": ([(1024, 512), (512, 512), (3072, 512), (512, 1536)], 8),
    "100m": ([(1280, 768), (768, 768), (4096, 768), (768, 2048)], 12),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--rows", default="1,64", help="M values (tokens of a step), comma separated")
    parser.add_argument("--reps", type=int, default=40, help="timed passes over the layers per case")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if not cpu_kernel_runs():
        raise SystemExit("the int8 W8A8 CPU kernel does not run here (no AVX-512 VNNI, or no compiler)")
    ops = cpu_layer_ops(args.threads)
    shapes, layers = MODELS[args.model]
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=generator).bfloat16() for _ in range(layers) for n, k in shapes]
    bf16 = [(w, ops.prepare_linear_weight(w)) for w in weights]
    int8 = [int8_layer(w) for w in weights]
    print(f"{args.model}: {len(weights)} layers, {sum(w.numel() for w in weights) / 2**20:.1f} M weights, "
          f"{args.threads} threads; ms per pass over all of them (median of {args.reps})")
    print("| M | bf16 | int8 packed | int8 row-major | packed vs bf16 |")
    print("|---|---|---|---|---|")
    for m in (int(r) for r in args.rows.split(",")):
        inputs = {k: torch.randn(m, k, generator=generator).bfloat16() for _, k in shapes}
        check(int8[0], inputs[shapes[0][1]])
        cases = step_cases(ops, bf16, int8, inputs)
        times = interleaved(cases, args.reps)
        print(f"| {m} | {times['bf16']:.3f} | {times['packed']:.3f} | {times['row-major']:.3f} "
              f"| {times['bf16'] / times['packed']:.2f}x |", flush=True)


def cpu_layer_ops(threads: int) -> Any:
    from tokenmill_platform_cpu.allocator import keep_freed_memory, retain_bytes
    from tokenmill_platform_cpu.kernels import load_kernels
    from tokenmill_platform_cpu.layer_ops import CpuLayerOps

    keep_freed_memory(retain_bytes())  # as the engine's process runs
    kernels = load_kernels()
    if kernels is None:
        raise SystemExit("the CPU platform's kernels are not built here")
    torch.set_num_threads(threads)
    kernels.set_pool_threads(threads)
    return CpuLayerOps(kernels, 1 << 40)


def step_cases(ops: Any, bf16: list[tuple[torch.Tensor, Any]], int8: list[tuple[torch.Tensor, ...]],
               inputs: dict[int, torch.Tensor]) -> dict[str, Callable[[], None]]:
    """One pass over every layer, for each case."""

    def run_bf16() -> None:
        for weight, prepared in bf16:
            ops.linear(inputs[weight.shape[1]], weight, None, prepared)

    def run_packed() -> None:
        for quantized, panels, scale, row_sum in int8:
            w8a8_linear_packed_cpu(inputs[quantized.shape[1]], panels, quantized.shape[1], scale, row_sum, None)

    def run_row_major() -> None:
        for quantized, _, scale, row_sum in int8:
            w8a8_linear_cpu(inputs[quantized.shape[1]], quantized, scale, row_sum, None)

    return {"bf16": run_bf16, "packed": run_packed, "row-major": run_row_major}


def int8_layer(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    quantized, scale = quantize_weight_per_channel(weight.float())
    quantized = quantized.contiguous()
    return quantized, w8a8_pack_panels_cpu(quantized), scale.contiguous(), quantized.sum(dim=1, dtype=torch.int32)


def check(layer: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], x: torch.Tensor) -> None:
    quantized, panels, scale, row_sum = layer
    expected = w8a8_linear_torch(x, quantized, scale, None)
    packed = w8a8_linear_packed_cpu(x, panels, quantized.shape[1], scale, row_sum, None)
    assert torch.equal(packed, expected), "packed differs"
    assert torch.equal(w8a8_linear_cpu(x, quantized, scale, row_sum, None), expected), "row-major differs"


def interleaved(cases: dict[str, Callable[[], None]], reps: int) -> dict[str, float]:
    for run in cases.values():  # warm-up
        run()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(reps):
        for name, run in cases.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


if __name__ == "__main__":
    main()
