#!/usr/bin/env python
"""Time GGUF's Triton matmul on a GPU at a Llama-3-8B layer's shapes, against the torch reference.

For each block type, row count (1 is decode at batch 1) and weight shape ``N x K`` (q/k/v merged,
o, gate/up merged, down), the median microseconds of:

- ``triton``: :func:`~tokenmill_quant_gguf.triton_kernels.gguf_linear_triton` as the GGUF methods call it
  (its K loop split as :func:`~tokenmill_quant_gguf.triton_kernels.k_splits` says);
- ``triton-1``: the same kernel with the K loop never split (what the split buys at few rows);
- ``reference``: what ran on a GPU before it, dequantise the block rows then a float32 matmul;
- ``float``: cuBLAS on the weight already dequantised to the activations' dtype (a dequantised model,
  four times the memory of Q8_0).

and the weight bytes read per second by ``triton`` (GB/s, against the card's HBM bandwidth at decode).
The blocks are random bytes with finite float16 scales (timing does not depend on the values).

    python scripts/bench-gguf-triton.py [--types q4_0,q8_0,q4_k,q6_k] [--rows 1,8,64,512]
                                        [--dtype bfloat16] [--iters 50] [--output-json FILE]

A benchmark, not a test; on the CPU (``TRITON_INTERPRET=1 ... --device cpu --shapes 64x64``) it only
checks that it runs.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from tokenmill_quant_gguf.blocks import block_geometry, dequantize_rows, row_bytes
from tokenmill_quant_gguf.kernels import gguf_linear_reference
from tokenmill_quant_gguf.triton_kernels import gguf_linear_triton, k_splits

LLAMA3_8B = "6144x4096,4096x4096,28672x4096,4096x14336"  # N x K: qkv, o, gate_up, down


def random_blocks(qtype: GGMLQuantizationType, n: int, k: int, device: str) -> torch.Tensor:
    """uint8 block rows ``[n, bytes]``: random bytes, the float16 scale fields set to small finite values."""
    nbytes = block_geometry(qtype)[1]
    blocks = torch.randint(0, 256, (n * k // block_geometry(qtype)[0], nbytes), dtype=torch.uint8, device=device)
    halves = (torch.randn(blocks.shape[0], 2, device=device) * 0.01).half().view(torch.uint8)
    fields = [208] if qtype == GGMLQuantizationType.Q6_K else [0, 2]  # d (Q6_K), else d and m / dmin
    for field, half in zip(fields, (halves[:, 0:2], halves[:, 2:4]), strict=False):
        blocks[:, field:field + 2] = half
    return blocks.reshape(n, row_bytes(qtype, k))


def median_us(run: Callable[[], object], iters: int, device: str) -> float:
    run()  # compiles / warms up
    samples = []
    for _ in range(iters):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if device == "cuda":
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", default="q4_0,q8_0,q4_k,q6_k")
    parser.add_argument("--rows", default="1,8,64,512")
    parser.add_argument("--shapes", default=LLAMA3_8B, help="N x K of each weight, comma-separated")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--output-json")
    args = parser.parse_args()
    dtype, device = getattr(torch, args.dtype), args.device
    results = []
    print(f"{'type':6} {'rows':>5} {'N x K':>12} {'splits':>6} {'triton':>9} {'triton-1':>9} {'reference':>10} "
          f"{'float':>8} {'GB/s':>7}")
    for name in args.types.split(","):
        qtype = GGMLQuantizationType[name.upper()]
        for shape in args.shapes.split(","):
            n, k = (int(side) for side in shape.split("x"))
            qweight = random_blocks(qtype, n, k, device)
            weight = dequantize_rows(qweight, qtype, k).to(dtype)
            for m in (int(rows) for rows in args.rows.split(",")):
                x = torch.randn(m, k, device=device, dtype=dtype)
                paths = {
                    "triton": functools.partial(gguf_linear_triton, x, qweight, qtype, k),
                    "triton-1": functools.partial(gguf_linear_triton, x, qweight, qtype, k, splits=1),
                    "reference": functools.partial(gguf_linear_reference, x, qweight, qtype, k),
                    "float": functools.partial(F.linear, x, weight),
                }
                times = {path: median_us(run, args.iters, device) for path, run in paths.items()}
                splits = k_splits(m, n, k // 32, torch.device(device))
                bandwidth = qweight.numel() / times["triton"] / 1e3
                results.append({"type": qtype.name, "rows": m, "n": n, "k": k, "splits": splits,
                                "gb_per_s": bandwidth, **{f"{path}_us": us for path, us in times.items()}})
                print(f"{qtype.name:6} {m:5} {shape:>12} {splits:6} {times['triton']:9.1f} {times['triton-1']:9.1f} "
                      f"{times['reference']:10.1f} {times['float']:8.1f} {bandwidth:7.0f}", flush=True)
    if args.output_json:
        with open(args.output_json, "w") as out:
            json.dump({"device": torch.cuda.get_device_name(0) if device == "cuda" else device, "dtype": args.dtype,
                       "results": results}, out, indent=1)


if __name__ == "__main__":
    main()
