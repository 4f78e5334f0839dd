"""The CPU paged attention kernel on its own: a batch-64 decode step's attention over 12 layers
of KV blocks on huge pages (as the engine's cache is), and whole prompts' causal attention
through the kernel against SDPA per request (the choice KERNEL_MAX_SEQ_LEN makes in
tokenmill_platform_cpu/attention.py). Defaults are the 100M benchmark model's shapes.

    python scripts/bench_cpu_attention.py                  # both, bfloat16
    python scripts/bench_cpu_attention.py --dtype float32 --only prompts

Best and median of the timed calls; the output is for reading, not asserting.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenmill.worker.host_memory import lazy_zeros
from tokenmill_platform_cpu.attention import _heads_first as heads_first  # [T, H, D] -> [1, H, T, D], as the backend's
from tokenmill_platform_cpu.kernels import load_kernels

BLOCK = 16


def timed(call: Callable[[], object], repeats: int) -> tuple[float, float]:
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[0], times[len(times) // 2]


def cache(blocks: int, kv_heads: int, head: int, dtype: torch.dtype) -> torch.Tensor:
    out = lazy_zeros((blocks, BLOCK, kv_heads, head), dtype, huge_pages=True)
    return out.copy_(torch.randn(blocks, BLOCK, kv_heads, head))


def decode(kernels, args: argparse.Namespace, dtype: torch.dtype) -> None:
    batch, context, layers = 64, args.context, 12
    per_request = -(-context // BLOCK)
    blocks = batch * per_request + 8
    caches = [(cache(blocks, args.kv_heads, args.head, dtype), cache(blocks, args.kv_heads, args.head, dtype))
              for _ in range(layers)]
    table = torch.randperm(blocks)[: batch * per_request].reshape(batch, per_request)
    query = torch.randn(batch, args.heads, args.head).to(dtype)
    requests, positions = torch.arange(batch), torch.full((batch,), context - 1)

    def step() -> None:
        for keys, values in caches:
            kernels.paged_attention(query, keys, values, table, requests, positions, args.head**-0.5, 0)

    best, median = (t / layers for t in timed(step, 15))
    read = batch * context * args.kv_heads * args.head * 2 * dtype.itemsize
    print(f"decode, batch {batch}, {context} tokens: {1e3 * best:.3f} ms a layer at best "
          f"({read / best / 1e9:.1f} GB/s), median {1e3 * median:.3f}")


def prompt_case(kernels, args: argparse.Namespace, dtype: torch.dtype, count: int, length: int) -> None:
    scale = args.head**-0.5
    per_request = -(-length // BLOCK)
    blocks = count * per_request + 4
    keys, values = (torch.randn(blocks, BLOCK, args.kv_heads, args.head).to(dtype) for _ in range(2))
    table = torch.randperm(blocks)[: count * per_request].reshape(count, per_request)
    query = torch.randn(count * length, args.heads, args.head).to(dtype)
    rows = [(table[r].repeat_interleave(BLOCK) * BLOCK + torch.arange(per_request * BLOCK) % BLOCK)[:length]
            for r in range(count)]
    seq_keys = [heads_first(keys.flatten(0, 1)[r]) for r in rows]
    seq_values = [heads_first(values.flatten(0, 1)[r]) for r in rows]
    requests, positions = torch.arange(count).repeat_interleave(length), torch.arange(length).repeat(count)

    def sdpa() -> torch.Tensor:
        return torch.cat([F.scaled_dot_product_attention(
            heads_first(query[r * length:(r + 1) * length]), seq_keys[r], seq_values[r], is_causal=True,
            scale=scale, enable_gqa=True)[0].transpose(0, 1) for r in range(count)])

    def kernel() -> torch.Tensor:
        return kernels.paged_attention(query, keys, values, table, requests, positions, scale, 0)

    difference = (sdpa().float() - kernel().float()).abs().max().item()
    print(f"prompts {count} x {length}: SDPA {1e3 * timed(sdpa, 5)[0]:.2f} ms, kernel "
          f"{1e3 * timed(kernel, 5)[0]:.2f} ms (best of 5; largest difference {difference:.1e})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head", type=int, default=64)
    parser.add_argument("--context", type=int, default=192, help="decode: tokens each request attends to")
    parser.add_argument("--only", choices=["decode", "prompts"])
    args = parser.parse_args()
    kernels = load_kernels()
    if kernels is None:
        raise SystemExit("the CPU kernels did not build")
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    if args.only != "prompts":
        decode(kernels, args, dtype)
    if args.only != "decode":
        for count, length in [(64, 128), (32, 256), (16, 512), (8, 768), (4, 1024), (2, 2048)]:
            prompt_case(kernels, args, dtype, count, length)


if __name__ == "__main__":
    main()
