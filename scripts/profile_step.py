"""Where one engine step's time goes: the torch profiler over a generate call.

    python scripts/profile_step.py bench-models/tiny --batch-size 64
    python scripts/profile_step.py MODEL --batch-size 1 --dtype bfloat16   # on a GPU

Prints wall ms per decode step, the top operators by self CPU time (and by
device time on CUDA), and, where decode steps replay step graphs (the CPU
platform's), the time of each kernel inside them, which the torch profiler sees
as one opaque call. The output is for reading, not asserting.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from tokenmill import LLM, SamplingParams
from tokenmill.worker.step_graphs import KernelProfile


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--rows", type=int, default=25)
    args = parser.parse_args()

    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.input_len + args.output_len + 16,
              max_num_seqs=max(args.batch_size, 1), kv_cache_memory="512MiB")
    params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(_prompts(args, seed=0), params, use_tqdm=False)  # warm-up (kernel builds, allocator)

    start = time.perf_counter()
    llm.generate(_prompts(args, seed=1), params, use_tqdm=False)
    wall = time.perf_counter() - start
    print(f"batch {args.batch_size}: {wall / args.output_len * 1e3:.2f} ms per step (incl. prefill), "
          f"{args.batch_size * args.output_len / wall:.1f} output tok/s")

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        llm.generate(_prompts(args, seed=2), params, use_tqdm=False)
    table = prof.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if cuda:
        print(table.table(sort_by="self_cuda_time_total", row_limit=args.rows))
    _print_graph_kernels(llm, args, params)


def _print_graph_kernels(llm: LLM, args: argparse.Namespace, params: SamplingParams) -> None:
    executor = llm.engine.core.executor
    profile = KernelProfile()
    if not executor.collective_rpc(_set_kernel_profile, (profile,))[0]:
        return
    llm.generate(_prompts(args, seed=3), params, use_tqdm=False)
    executor.collective_rpc(_set_kernel_profile, (None,))
    if not profile.steps:
        print("no decode step replayed a graph that times its kernels")
        return
    total = sum(profile.seconds.values())
    print(f"step graphs: {profile.steps} replays, {total / profile.steps * 1e3:.3f} ms of kernels per replay")
    for name, seconds in sorted(profile.seconds.items(), key=lambda item: -item[1]):
        calls = profile.calls[name]
        print(f"  {name:20s} {seconds / profile.steps * 1e3:8.3f} ms/replay  {calls / profile.steps:5.0f} calls"
              f"  {seconds / calls * 1e6:9.1f} us/call  {seconds / total:6.1%}")


def _set_kernel_profile(worker: Any, profile: KernelProfile | None) -> bool:
    """On the worker: time the step graphs' kernels into ``profile`` (in-process executors only:
    the profile is filled where the worker runs); False where no step graphs run."""
    graphs = worker.runner.graphs
    if graphs is None:
        return False
    graphs.kernel_profile = profile
    return True


def _prompts(args: argparse.Namespace, seed: int) -> list[dict]:
    """Fresh random prompts per run: repeating them would hit the prefix cache."""
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 30000) for _ in range(args.input_len)]}
            for _ in range(args.batch_size)]


if __name__ == "__main__":
    main()
