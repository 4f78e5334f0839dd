"""One linear layer at a time: bfloat16 / float32 matmul against the int8 W8A8 paths (a
micro-benchmark, not a test; run it on a quiet machine).

The shapes are the benchmark Llamas' projections (tiny: hidden 512, MLP 1536; 100m: 768,
2048; q/k/v and gate/up merged as tokenmill runs them), at M rows (tokens of one step):

* ``bf16`` / ``f32``: ``F.linear`` on the float weight (oneDNN / MKL);
* ``int8 torch``: the torch path (``quantize_per_token``, ``torch._int_mm``, ``scale_output``);
* ``_int_mm only``: the int8 product alone, the activations already quantized;
* ``kernel tiles`` / ``kernel int_mm`` / ``kernel panels``: the plugin's fused AVX-512 VNNI kernel with
  its three products (its own register tiles over the weight as stored; ``torch._int_mm`` between
  its quantization and scaling passes; its own broadcast tiles over weight panels it packs per call), activations bfloat16 as in a bfloat16 model, each checked
  equal to the torch path first. ``auto`` takes tiles below 16 rows.

    python scripts/bench_int8_linear.py                   # M = 1, 64, 512; torch's default threads
    python scripts/bench_int8_linear.py --rows 64 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenmill_quant_int8.kernels import (
    cpu_kernel_runs,
    int8_matmul_int_mm,
    quantize_per_token,
    quantize_weight_per_channel,
    w8a8_linear_cpu,
    w8a8_linear_torch,
)

SHAPES = {  # name: (K inputs, N outputs)
    "tiny qkv": (512, 1024), "tiny o": (512, 512), "tiny gate_up": (512, 3072), "tiny down": (1536, 512),
    "100m qkv": (768, 1280), "100m gate_up": (768, 4096), "100m down": (2048, 768),
}


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def microseconds(call: Callable[[], object], budget_s: float, clock: Callable[[], float]) -> float:
    """Median time of one call on ``clock``, over as many calls as fit in ``budget_s`` of it
    (after 3 warm-ups). The CPU clock (the process's CPU time, all threads) counts only the
    time the call ran, so it stays meaningful on a shared machine; wall time is the figure on
    a quiet one."""
    for _ in range(3):
        call()
    times: list[float] = []
    deadline = clock() + budget_s
    while clock() < deadline or len(times) < 5:
        start = clock()
        call()
        times.append(clock() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,64,512", help="M values, comma separated")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--budget", type=float, default=0.3, help="seconds of timing per cell")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall (a quiet machine) or cpu (the process's CPU time: a shared one)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma separated, of: " + ", ".join(SHAPES))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    fused = cpu_kernel_runs()
    clock = CLOCKS[args.clock]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fused kernel: {fused}, {args.clock} clock")
    print("| shape | M | bf16 µs | f32 µs | int8 torch µs | _int_mm only µs | kernel tiles µs | kernel int_mm µs "
          "| kernel panels µs | best kernel vs bf16 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    generator = torch.Generator().manual_seed(0)
    for name in args.shapes.split(","):
        k, n = SHAPES[name.strip()]
        weight = torch.randn(n, k, generator=generator) * k ** -0.5
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, generator=generator)
            print(f"| {name} | {m} | " + " | ".join(measure(x, weight, fused, args.budget, clock)) + " |", flush=True)


def measure(x: torch.Tensor, weight: torch.Tensor, fused: bool, budget: float, clock: Callable[[], float]) -> list[str]:
    """The row's cells: each path's time for ``x @ weight.T``, and the best kernel's speed-up over bfloat16."""
    x_bf16, w_bf16 = x.bfloat16(), weight.bfloat16()
    wq, w_scale = quantize_weight_per_channel(weight)
    row_sum = wq.sum(dim=1, dtype=torch.int32)
    xq, _ = quantize_per_token(x_bf16)
    cells = {
        "bf16": microseconds(lambda: F.linear(x_bf16, w_bf16), budget, clock),
        "f32": microseconds(lambda: F.linear(x, weight), budget, clock),
        "torch": microseconds(lambda: w8a8_linear_torch(x_bf16, wq, w_scale, None), budget, clock),
        "int_mm": microseconds(lambda: int8_matmul_int_mm(xq, wq), budget, clock),
    }
    kernels = {}
    if fused:
        expected = w8a8_linear_torch(x_bf16, wq, w_scale, None)
        for product in ("tiles", "int_mm", "panels"):
            def call(product: str = product) -> torch.Tensor:
                return w8a8_linear_cpu(x_bf16, wq, w_scale, row_sum, None, product)
            assert torch.equal(call(), expected), f"the {product} kernel differs from the torch path"
            kernels[product] = microseconds(call, budget, clock)
    shown = [f"{cells[c]:.1f}" for c in ("bf16", "f32", "torch", "int_mm")]
    shown += [f"{kernels[p]:.1f}" if p in kernels else "—" for p in ("tiles", "int_mm", "panels")]
    return [*shown, f"{cells['bf16'] / min(kernels.values()):.2f}x" if kernels else "—"]

if __name__ == "__main__":
    main()
