"""Where a decode step's time goes outside the model's forward: each phase of the engine's
step timed by wrapping its method, per step, through ``LLM.generate`` and through the loop
``tokenmill bench latency`` runs (the bench backend's).

    python scripts/step_split.py bench-models/quant/tiny-gguf-q4_0 --input-len 32 --output-len 64
    python scripts/step_split.py MODEL --cprofile 30     # and the 30 costliest functions, by own time

Times are inclusive (a phase contains the phases indented under it); "rest" is a phase's time
outside the phases listed under it. The wrappers add well under a microsecond a call. The
output is for reading, not asserting.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import importlib
import pstats
import random
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from tokenmill import LLM, SamplingParams
from tokenmill.worker.step_graphs import KernelProfile

# (label, depth, path from the LLM to the object (or module:NAME), method name)
PHASES = [
    ("engine.step", 0, "engine", "step"),
    ("core.step", 1, "engine.core", "step"),
    ("schedule", 2, "engine.core.scheduler", "schedule"),
    ("execute_model", 2, "engine.core.executor", "execute_model"),
    ("update_states", 3, "engine.core.executor.worker.runner", "_update_states"),
    ("build_step_inputs", 3, "module:tokenmill.worker.model_runner", "build_step_inputs"),
    ("backend.prepare", 3, "engine.core.executor.worker.runner.backend", "prepare"),
    ("forward", 3, "engine.core.executor.worker.runner", "_forward"),
    ("graphs.forward", 4, "engine.core.executor.worker.runner.graphs", "forward"),
    ("graph kernels", 5, "", ""),  # --kernels: not a method, filled from the kernel profile
    ("grammar_bitmask", 2, "engine.core.scheduler", "grammar_bitmask"),
    ("sample_tokens", 2, "engine.core.executor", "sample_tokens"),
    ("sampler", 3, "engine.core.executor.worker.runner", "sampler"),
    ("update_from_output", 2, "engine.core.scheduler", "update_from_output"),
    ("make_stats", 2, "engine.core.scheduler", "make_stats"),
    ("output_processor", 1, "engine.output_processor", "process"),
    ("record_stats", 1, "engine", "_record_stats"),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--iters", type=int, default=5, help="runs per path; the split is the median's")
    parser.add_argument("--cprofile", type=int, default=0, help="also print this many functions by own time")
    parser.add_argument("--kernels", action="store_true",
                        help="also sum the step graphs' kernels (DecodeGraphs.kernel_profile): a replay's "
                             "time outside them is its dispatch and the compute threads' hand-offs")
    parser.add_argument("--clock", choices=["wall", "thread"], default="wall",
                        help="thread: the calling thread's CPU time, which a busy machine inflates less "
                             "(but misses the compute threads' share of a forward)")
    args = parser.parse_args()

    llm = LLM(args.model, max_model_len=args.input_len + args.output_len + 16, max_num_seqs=1,
              kv_cache_memory="512MiB")
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    paths: dict[str, Callable[[int], None]] = {
        "LLM.generate": lambda seed: _generate(llm, args, params, seed),
        "bench latency": lambda seed: _bench_loop(llm, args, seed),
    }
    for run in paths.values():
        run(0)  # warm-up: kernel builds, graph capture, allocator
    timers = _install(llm, time.thread_time_ns if args.clock == "thread" else time.perf_counter_ns)
    graphs = llm.engine.core.executor.worker.runner.graphs
    for name, run in paths.items():
        splits = []
        for i in range(args.iters):
            timers.reset()
            if args.kernels and graphs is not None:
                graphs.kernel_profile = KernelProfile()
            start = timers.clock()
            run(1 + i)
            if graphs is not None and graphs.kernel_profile is not None:
                timers.ns["graph kernels"] = int(sum(graphs.kernel_profile.seconds.values()) * 1e9)
                timers.calls["graph kernels"] = graphs.kernel_profile.steps
            splits.append((timers.clock() - start, dict(timers.ns), dict(timers.calls)))
        splits.sort(key=lambda s: s[0])
        wall, ns, calls = splits[len(splits) // 2]
        _print_split(name, args.output_len, wall, ns, calls)
        if args.cprofile:
            profiler = cProfile.Profile()
            profiler.runcall(run, 100)
            print(f"-- {name}: cProfile, by own time")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(args.cprofile)


def _generate(llm: LLM, args: argparse.Namespace, params: SamplingParams, seed: int) -> None:
    llm.generate([_prompt(args, seed)], params, use_tqdm=False)


def _bench_loop(llm: LLM, args: argparse.Namespace, seed: int) -> None:
    """The bench backend's loop (``TokenmillBackend.run``) around this LLM, without its records."""
    from tokenmill_cli.bench.datasets import BenchRequest
    from tokenmill_cli.bench.tokenmill_backend import TokenmillBackend

    backend = TokenmillBackend.__new__(TokenmillBackend)  # the loop only, on the LLM built here
    backend.llm = llm
    backend.run([BenchRequest(_prompt(args, seed)["prompt_token_ids"], args.output_len)], 0.0)


def _prompt(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """Fresh random prompts per run: repeating them would hit the prefix cache."""
    rng = random.Random(seed)
    return {"prompt_token_ids": [rng.randrange(3, 30000) for _ in range(args.input_len)]}


class _Timers:
    def __init__(self, clock: Callable[[], int]) -> None:
        self.clock = clock
        self.ns: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    def reset(self) -> None:
        self.ns.clear()
        self.calls.clear()

    def wrap(self, label: str, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def timed(*a: Any, **kw: Any) -> Any:
            start = self.clock()
            try:
                return method(*a, **kw)
            finally:
                self.ns[label] += self.clock() - start
                self.calls[label] += 1
        return timed


def _install(llm: LLM, clock: Callable[[], int]) -> _Timers:
    """Wrap each phase's method on its object (an instance attribute shadows the class's)."""
    timers = _Timers(clock)
    for label, _, path, name in PHASES:
        if not name:
            continue
        owner: Any = llm
        if path.startswith("module:"):  # a function the caller's module imported
            owner = importlib.import_module(path.removeprefix("module:"))
        else:
            for part in path.split("."):
                owner = getattr(owner, part, None)
        method = getattr(owner, name, None) if owner is not None else None
        if method is None:
            print(f"(no {path}.{name}: {label} is not timed)")
            continue
        setattr(owner, name, timers.wrap(label, method))
    return timers


def _print_split(name: str, output_len: int, wall: int, ns: dict[str, int], calls: dict[str, int]) -> None:
    steps = max(calls.get("engine.step", 1), 1)
    print(f"-- {name}: {wall / 1e6:.2f} ms a run, {steps} steps, {wall / steps / 1e3:.1f} us a step "
          f"({output_len} tokens; per step below, prefill included)")
    print(f"   {'loop outside engine.step':28s} {(wall - ns.get('engine.step', 0)) / steps / 1e3:8.1f} us")
    for i, (label, depth, _, _) in enumerate(PHASES):
        if label not in ns:
            continue
        inner = 0
        for sub_label, sub_depth, _, _ in PHASES[i + 1:]:
            if sub_depth <= depth:
                break
            if sub_depth == depth + 1:
                inner += ns.get(sub_label, 0)
        rest = f"  (rest {(ns[label] - inner) / steps / 1e3:6.1f} us)" if inner else ""
        print(f"   {'  ' * depth + label:28s} {ns[label] / steps / 1e3:8.1f} us  x{calls[label] / steps:.2f}{rest}")


if __name__ == "__main__":
    main()
