#!/usr/bin/env python
"""Time the GGUF CPU kernel's matmul per ggml type: its vectorised path against its portable loop.

One ``x[M, K] @ W[N, K].T`` per type, at M = 1 (decode) and M = 64 (a prefill chunk or a
batch), for a square 2048 x 2048 weight and SmolLM2's ``down_proj`` (N = 576, K = 1536).
``gguf_matmul`` runs the path the build CPU gets (``kernel_path``), ``gguf_matmul_portable``
the portable loop every type keeps as its reference and fallback, the op with quantised
activations (``q8x3``, ``q8x2``, ``q8``: integer dot products, AVX-512 VNNI) where the type has that
path; a float32 ``F.linear`` on the dequantised weight is the yardstick. The two kernel paths are timed in alternation, each
sample the median of a few calls, so a busy machine slows both alike and the ratio (the
column worth reading on a shared machine) holds better than the absolute times.

    python scripts/bench-gguf-kernels.py [--threads 1] [--rounds 5]

A benchmark, not a test: it asserts nothing but that both paths agree.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from tokenmill_quant_gguf.blocks import KEPT_QUANTIZED, dequantize_rows
from tokenmill_quant_gguf.cpu_kernel import load_cpu_kernel
from tokenmill_quant_gguf.kquants import K_QUANTS

SHAPES = {"2048x2048": (2048, 2048), "smollm2 down 576x1536": (576, 1536)}


def random_blocks(n: int, k: int, qtype: GGMLQuantizationType) -> torch.Tensor:
    """Block rows of ``qtype``: random weights packed by the gguf package, or random bytes in
    the K-quant layouts (which it cannot pack) with small finite float16 scales."""
    rng = np.random.default_rng(0)
    if qtype not in K_QUANTS:
        values = rng.standard_normal((n, k)).astype(np.float32)
        return torch.from_numpy(np.ascontiguousarray(quantize(values, qtype)))
    size = {GGMLQuantizationType.Q4_K: 144, GGMLQuantizationType.Q5_K: 176, GGMLQuantizationType.Q6_K: 210}[qtype]
    blocks = rng.integers(0, 256, (n * k // 256, size), dtype=np.uint8)
    halves = (rng.standard_normal((blocks.shape[0], 2)) * 0.01).astype(np.float16).view(np.uint8)
    if qtype == GGMLQuantizationType.Q6_K:
        blocks[:, 208:210] = halves[:, 0:2]
    else:
        blocks[:, 0:4] = halves
    return torch.from_numpy(blocks.reshape(n, -1))


def sample(call: Callable[..., torch.Tensor], args: tuple[object, ...], calls: int) -> float:
    """Median seconds of one ``call(*args)`` over ``calls`` calls."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def alternate(fast: Callable[..., torch.Tensor], slow: Callable[..., torch.Tensor], args: tuple[object, ...],
              rounds: int, calls: int) -> tuple[float, float]:
    """The best sample of each of ``fast`` and ``slow``, timed in alternation."""
    fast_times, slow_times = [], []
    for _ in range(rounds):
        fast_times.append(sample(fast, args, calls))
        slow_times.append(sample(slow, args, calls))
    return min(fast_times), min(slow_times)


def quantised(kernel: object, case: tuple[object, ...], activations: str, args: argparse.Namespace) -> str:
    """Milliseconds of the op with quantised activations (the best of `rounds` samples), "-" where
    the type has no such path here."""
    if kernel.kernel_path(case[2], activations) != "avx512_vnni":  # type: ignore[attr-defined]
        return "-"
    op = torch.ops.tokenmill_gguf.matmul
    best = min(sample(lambda *a: op(*a, None, activations), case, args.calls) for _ in range(args.rounds))
    return f"{best * 1e3:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5, help="alternating samples per path")
    parser.add_argument("--calls", type=int, default=5, help="calls per sample")
    parser.add_argument("--rows", default="1,64", help="comma separated row counts M of x")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernel = load_cpu_kernel()
    if kernel is None:
        raise SystemExit("the GGUF CPU kernel did not build here")
    print(f"kernel: {kernel.isa()}; {args.threads} thread(s); median of {args.calls} calls, "
          f"min over {args.rounds} alternating rounds")
    print(f"{'shape':>22} {'type':>5} {'M':>3} {'path':>7} {'vectorised ms':>13} {'portable ms':>11} "
          f"{'speed-up':>8} {'q8x3 ms':>8} {'q8x2 ms':>8} {'q8 ms':>8} {'f32 linear ms':>13}")
    for label, (n, k) in SHAPES.items():
        for qtype in sorted(KEPT_QUANTIZED, key=int):
            qweight = random_blocks(n, k, qtype)
            weight = dequantize_rows(qweight, qtype, k)
            for m in (int(rows) for rows in args.rows.split(",")):
                x = torch.randn(m, k)
                fast = kernel.gguf_matmul(x, qweight, int(qtype), k)
                slow = kernel.gguf_matmul_portable(x, qweight, int(qtype), k)
                torch.testing.assert_close(fast, slow, rtol=1e-3, atol=1e-3 * float(slow.abs().max()))
                case = (x, qweight, int(qtype), k)
                v, p = alternate(kernel.gguf_matmul, kernel.gguf_matmul_portable, case, args.rounds, args.calls)
                dense = sample(F.linear, (x, weight), args.calls)
                q8x3, q8x2, q8 = (quantised(kernel, case, activations, args) for activations in ("q8x3", "q8x2", "q8"))
                print(f"{label:>22} {qtype.name:>5} {m:>3} {kernel.kernel_path(int(qtype)):>7} {v * 1e3:>13.3f} "
                      f"{p * 1e3:>11.3f} {p / v:>7.2f}x {q8x3:>8} {q8x2:>8} {q8:>8} {dense * 1e3:>13.3f}")


if __name__ == "__main__":
    main()
