#!/usr/bin/env python
"""Time the GGUF op ``tokenmill_gguf::matmul`` at decode shapes, per path, against the memory bound.

A decode step multiplies every weight of the model once by a few rows of x; at batch 1 the
step is bound by reading the weights' bytes. This script builds one model's worth of random
GGUF weights of a block type (each linear layer of every decoder layer, the lm_head), runs the
op over all of them in order as a decode step does (the "sweep", so each weight is read cold
from wherever the previous sweep left it: L3 for the tiny model's 22 MiB of Q4_0, memory for
larger), and reports per activation path:

- us per sweep, us per call (the mean), and the effective GB/s of weight bytes read;
- the read bound: the same byte count read by ``torch.amax`` over int32 buffers of buffers of
  the same sizes, in the same order (what streaming the bytes costs with no arithmetic).

    python scripts/bench-gguf-matmul.py [--models tiny,smollm2] [--types q4_0,q8_0] [--rows 1,4,8]
                                        [--threads 1,2] [--paths float32,q8,q8x2,q8x3] [--clock wall|cpu]

Paths are timed in alternation, each sample the median of ``--calls`` sweeps, the best sample
reported, so a busy machine slows each alike: on a shared machine read the ratios. ``auto``
marks the path the GGUF methods take (``kernels.AUTO_ACTIVATIONS``). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from tokenmill_quant_gguf.blocks import row_bytes
from tokenmill_quant_gguf.cpu_kernel import load_cpu_kernel
from tokenmill_quant_gguf.kernels import resolved_activations
from tokenmill_quant_gguf.kquants import K_QUANTS


@dataclass(frozen=True)
class Model:
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    q_heads: int
    kv_heads: int
    head_dim: int = 64

    def shapes(self) -> list[tuple[str, int, int]]:
        """(name, N, K) of each linear of a decode step, in order: q/k/v merged, o, gate/up merged, down
        per layer, then the lm_head."""
        qkv = (self.q_heads + 2 * self.kv_heads) * self.head_dim
        layer = [("qkv", qkv, self.hidden), ("o", self.hidden, self.q_heads * self.head_dim),
                 ("gate_up", 2 * self.intermediate, self.hidden), ("down", self.hidden, self.intermediate)]
        return layer * self.layers + [("lm_head", self.vocab, self.hidden)]


MODELS = {"tiny": Model(512, 1536, 8, 32000, 8, 4), "smollm2": Model(576, 1536, 30, 49152, 9, 3)}


def random_blocks(n: int, k: int, qtype: GGMLQuantizationType, seed: int) -> torch.Tensor:
    """[n, row bytes] of random weights packed by the gguf package (random bytes with small scales for
    the K-quants, which it cannot pack)."""
    rng = np.random.default_rng(seed)
    if qtype not in K_QUANTS:
        return torch.from_numpy(np.ascontiguousarray(quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)))
    blocks = rng.integers(0, 256, (n * k // 256, row_bytes(qtype, 256)), dtype=np.uint8)
    halves = (rng.standard_normal((blocks.shape[0], 2)) * 0.01).astype(np.float16).view(np.uint8)
    if qtype == GGMLQuantizationType.Q6_K:
        blocks[:, 208:210] = halves[:, 0:2]
    else:
        blocks[:, 0:4] = halves
    return torch.from_numpy(blocks.reshape(n, -1))


def sweeper(op: Callable[..., torch.Tensor], calls: list[tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]],
            qtype: int, path: str) -> Callable[[], None]:
    """One decode step's matmuls: ``op`` on each (x, weight, K, out) of ``calls`` with activations ``path``."""
    def run() -> None:
        for x, weight, k, out in calls:
            op(x, weight, qtype, k, None, path, out=out)
    return run


def reader(views: list[torch.Tensor]) -> Callable[[], None]:
    """Reading the same bytes with no arithmetic to speak of: the bound a sweep could reach."""
    def run() -> None:
        for view in views:
            view.amax()
    return run


def best_of(calls: Callable[[], None], rounds: int, per_sample: int, clock: Callable[[], float]) -> list[float]:
    """Per-round median seconds of ``calls()`` by ``clock``."""
    samples = []
    for _ in range(rounds):
        times = []
        for _ in range(per_sample):
            start = clock()
            calls()
            times.append(clock() - start)
        samples.append(statistics.median(times))
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--types", default="q4_0,q4_1,q8_0")
    parser.add_argument("--rows", default="1,4,8")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--paths", default="float32,q8,q8x2,q8x3")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=5, help="sweeps per sample")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="wall time, or the process's CPU time (all threads' summed: work, not latency; "
                             "steadier on a shared machine, where a descheduled thread's wait is not counted)")
    args = parser.parse_args()
    kernel = load_cpu_kernel()
    if kernel is None:
        raise SystemExit("the GGUF CPU kernel did not build here")
    op = torch.ops.tokenmill_gguf.matmul.out
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    print(f"kernel: {kernel.isa()}; {args.clock} clock; best of {args.rounds} alternating rounds, each the median of {args.calls} sweeps")
    print(f"{'model':>8} {'type':>5} {'thr':>3} {'M':>2} {'path':>9} {'us/sweep':>9} {'us/call':>8} {'GB/s':>6} "
          f"{'of bound':>8} {'loop':>18}")
    for model_name in args.models.split(","):
        model = MODELS[model_name]
        for type_name in args.types.split(","):
            qtype = GGMLQuantizationType[type_name.upper()]
            shapes = model.shapes()
            distinct = {(n, k): random_blocks(n, k, qtype, seed) for seed, (_, n, k) in enumerate(shapes)}
            # every layer its own copy, so a sweep reads the model's bytes, not one layer's again
            weights = [distinct[(n, k)].clone() for _, n, k in shapes]
            total = sum(w.numel() for w in weights)
            views = [torch.empty(w.numel() // 4, dtype=torch.int32).random_(0, 100) for w in weights]
            for threads in (int(t) for t in args.threads.split(",")):
                torch.set_num_threads(threads)
                for m in (int(r) for r in args.rows.split(",")):
                    xs = {k: torch.randn(m, k) for _, _, k in shapes}
                    outs = [torch.empty(m, n) for _, n, _ in shapes]

                    calls = [(xs[k], w, k, out) for (_, _, k), w, out in zip(shapes, weights, outs, strict=True)]
                    read = reader(views)
                    paths = args.paths.split(",")
                    runs = {path: sweeper(op, calls, int(qtype), path) for path in paths}
                    for run in runs.values():
                        run()
                    timed: dict[str, list[float]] = {path: [] for path in paths}
                    bound: list[float] = []
                    for _ in range(args.rounds):
                        bound += best_of(read, 1, args.calls, clock)
                        for path in paths:
                            timed[path] += best_of(runs[path], 1, args.calls, clock)
                    floor = min(bound)
                    auto = resolved_activations(qtype, "auto")
                    print(f"{model_name:>8} {qtype.name:>5} {threads:>3} {m:>2} {'read':>9} {floor * 1e6:>9.0f} "
                          f"{floor * 1e6 / len(shapes):>8.1f} {total / floor / 1e9:>6.1f} {'1.00':>8} {'torch.amax':>18}")
                    for path in paths:
                        best = min(timed[path])
                        label = path + ("*" if path == auto else "")
                        loop = kernel.kernel_path(int(qtype), path, m)
                        print(f"{model_name:>8} {qtype.name:>5} {threads:>3} {m:>2} {label:>9} {best * 1e6:>9.0f} "
                              f"{best * 1e6 / len(shapes):>8.1f} {total / best / 1e9:>6.1f} {floor / best:>8.2f} "
                              f"{loop:>18}")
            print(f"# {model_name} {qtype.name}: {len(shapes)} calls a sweep, {total / 2**20:.1f} MiB of weights "
                  "(* = the auto path)")


if __name__ == "__main__":
    main()
