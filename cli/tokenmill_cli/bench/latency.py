"""``tokenmill bench latency``: one batch of fixed size, run again and again.

Each iteration is ``--batch-size`` fresh random prompts of ``--input-len``
tokens generating ``--output-len`` tokens each (EOS ignored). Prompts are
new every iteration so the prefix cache cannot turn later iterations'
prefills into lookups. Per iteration: its latency (first request added to
last token), TTFT (the batch's prefill) and TPOT (one decode step of the
whole batch). From TPOT: the per-token latency and the weight bandwidth
achieved, since each decode step reads every weight once; against it, how fast
this machine reads that many bytes at all (the batch-1 roofline).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import fmean
from typing import Any

import numpy as np

from tokenmill_cli.bench.backends import COMMUNICATION_ROWS, Backend, canonical_backend, create_backend
from tokenmill_cli.bench.background_load import background_load
from tokenmill_cli.bench.contention import CONTENTION_ROWS, contention_json, result_figures
from tokenmill_cli.bench.datasets import BenchRequest, Vocabulary
from tokenmill_cli.bench.metrics import DEFAULT_PERCENTILES, RequestRecord, summarize
from tokenmill_cli.bench.report import Row, latency_table, print_tables, summary_table
from tokenmill_cli.bench.roofline import achieved_gbps
from tokenmill_cli.bench.system import (
    cpu_json,
    cpu_kernels_json,
    measure_read_gbps,
    memory_json,
    process_start_time,
    startup_seconds,
)

VLLM_PERCENTILES = (10, 25, 50, 75, 90, 99)  # the `percentiles` object `vllm bench latency` writes


@dataclass(frozen=True)
class LatencyOptions:
    backend: str = "tokenmill"
    input_len: int = 32
    output_len: int = 128
    batch_size: int = 8
    num_iters_warmup: int = 3
    num_iters: int = 10
    temperature: float = 1.0
    seed: int = 0
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    disable_tqdm: bool = False
    background_load: int = 0  # > 0: run quiet, then beside this many busy processes (bench.background_load)
    background_kind: str = "matmul"


@dataclass(frozen=True)
class Iteration:
    latency_s: float
    ttft_s: float  # mean over the batch
    tpot_s: float  # mean over the batch
    first_token: float  # perf_counter time of the batch's first token


def run_latency(model: str | None, engine_kwargs: dict[str, Any], opts: LatencyOptions) -> dict[str, Any]:
    process_start = process_start_time()
    if opts.num_iters < 1 or opts.batch_size < 1 or opts.input_len < 1 or opts.output_len < 2:
        raise ValueError("--num-iters, --batch-size and --input-len must be at least 1, --output-len at least 2")
    backend_name = canonical_backend(opts.backend)
    # the whole batch must run together, or the iteration would measure queueing
    engine_kwargs = {**engine_kwargs, "max_num_seqs": max(engine_kwargs.get("max_num_seqs", 1), opts.batch_size)}
    backend = create_backend(backend_name, model, engine_kwargs, opts.batch_size)
    if backend.max_model_len is not None and opts.input_len + opts.output_len > backend.max_model_len:
        raise ValueError(f"--input-len + --output-len exceeds max_model_len={backend.max_model_len}")
    vocab = Vocabulary.from_tokenizer(backend.tokenizer, backend.vocab_size)
    rng = np.random.default_rng(opts.seed)

    def batch() -> list[BenchRequest]:
        return [BenchRequest(vocab.sample(rng, opts.input_len), opts.output_len) for _ in range(opts.batch_size)]

    warmups = [_iteration(backend, batch(), opts.temperature)
               for _ in _progress(opts.num_iters_warmup, "Warm-up", opts.disable_tqdm)]
    quiet = None
    if opts.background_load:  # the same iterations on the quiet machine first, to compare against
        quiet = _figures([_iteration(backend, batch(), opts.temperature)
                          for _ in _progress(opts.num_iters, "Quiet", opts.disable_tqdm)], opts.percentiles)
    before = backend.counters()
    with background_load(opts.background_load, opts.background_kind):
        iterations = [_iteration(backend, batch(), opts.temperature)
                      for _ in _progress(opts.num_iters, "Latency", opts.disable_tqdm)]
    first_token = (warmups or iterations)[0].first_token
    result = _result(backend, backend_name, model, opts, iterations, engine_kwargs,
                     startup_seconds(first_token, process_start))
    counters = backend.counters().since(before)
    return {**result, **counters.spec_decode_json(engine_kwargs), **counters.communication_json(), **cpu_json(),
            **cpu_kernels_json(),
            **contention_json(opts.background_load, opts.background_kind, result_figures(result), quiet)}


def _iteration(backend: Backend, requests: list[BenchRequest], temperature: float) -> Iteration:
    start = time.perf_counter()
    records = backend.run(requests, temperature)
    latency = time.perf_counter() - start
    done = [r for r in records if r.ok]
    if len(done) != len(records):
        errors = {r.error for r in records if not r.ok}
        raise RuntimeError(f"{len(records) - len(done)} of {len(records)} requests failed: {errors}")
    return Iteration(latency, fmean(r.ttft for r in done), fmean(_tpots(done)), min(r.output_times[0] for r in done))


def _tpots(records: Sequence[RequestRecord]) -> list[float]:
    return [t for r in records if (t := r.tpot) is not None]


def _result(backend: Backend, backend_name: str, model: str | None, opts: LatencyOptions,
            iterations: list[Iteration], engine_kwargs: dict[str, Any], startup_s: float | None) -> dict[str, Any]:
    latencies = [it.latency_s for it in iterations]
    tpot = fmean(it.tpot_s for it in iterations)
    result: dict[str, Any] = {
        "benchmark": "latency",
        "backend": backend_name,
        "model": model,
        "device": str(backend.device),
        "batch_size": opts.batch_size,
        "input_len": opts.input_len,
        "output_len": opts.output_len,
        "num_iters_warmup": opts.num_iters_warmup,
        "num_iters": opts.num_iters,
        "metric_percentiles": list(opts.percentiles),
        # `vllm bench latency`'s keys: seconds per iteration
        "avg_latency": fmean(latencies),
        "latencies": latencies,
        "percentiles": {str(p): float(np.percentile(latencies, p)) for p in VLLM_PERCENTILES},
        "output_throughput": opts.batch_size * opts.output_len / fmean(latencies),
    }
    result.update(_figures(iterations, opts.percentiles))
    memory = memory_json()  # before the ceiling's buffer (up to 1 GiB) can raise the peaks
    if backend.weights is not None:
        achieved = achieved_gbps(backend.weights, tpot)
        # measured after the run, as the throughput roofline's peak, with nothing else on the cores
        ceiling = measure_read_gbps(backend.device, backend.weights.step_bytes)
        result.update({"weight_bytes_per_step": backend.weights.step_bytes, "achieved_gbps": achieved,
                       "read_ceiling_gbps": ceiling, "bandwidth_fraction": achieved / ceiling if ceiling > 0 else 0.0})
    result.update({**memory, "startup_s": startup_s, "engine_args": engine_kwargs})
    return result


def _figures(iterations: list[Iteration], percentiles: tuple[float, ...]) -> dict[str, Any]:
    """Mean seconds per iteration and the latency/TTFT/TPOT summaries in ms (``mean_tpot_ms``, ...)."""
    figures: dict[str, Any] = {"avg_latency": fmean(it.latency_s for it in iterations)}
    for name, values in (("latency", [it.latency_s for it in iterations]), ("ttft", [it.ttft_s for it in iterations]),
                         ("tpot", [it.tpot_s for it in iterations])):
        figures.update({f"{stat}_{name}_ms": v for stat, v in summarize(values, percentiles, 1000.0).items()})
    return figures


def _progress(count: int, desc: str, disable: bool) -> Any:
    from tqdm import tqdm

    return tqdm(range(count), desc=desc, unit=" iter", disable=disable or count == 0)


LATENCY_ROWS: list[Row] = [
    ("Backend", "backend", ""),
    ("Batch size", "batch_size", "d"),
    ("Input / output tokens", "input_len", "d"),
    ("Iterations", "num_iters", "d"),
    ("Average latency (s)", "avg_latency", ".3f"),
    ("Per-token latency, TPOT (ms)", "mean_tpot_ms", ".2f"),
    ("Output token throughput (tok/s)", "output_throughput", ".1f"),
    ("Draft acceptance rate", "spec_decode_acceptance_rate", ".1%"),
    ("Mean accepted length", "spec_decode_mean_accepted_length", ".2f"),
    ("Requests switched off (low acceptance)", "spec_decode_num_paused_requests", "d"),
    ("Request steps without drafts (switched off)", "spec_decode_num_paused_steps", "d"),
    ("Steps without drafts (batch too large)", "spec_decode_num_steps_drafting_off", "d"),
    *COMMUNICATION_ROWS,
    ("Weight bytes read per step (MiB)", "weight_mib_per_step", ".1f"),
    ("Achieved bandwidth (GB/s)", "achieved_gbps", ".2f"),
    ("Read ceiling, same bytes (GB/s)", "read_ceiling_gbps", ".2f"),
    ("Bandwidth fraction", "bandwidth_fraction", ".2%"),
    ("Peak RSS (MiB)", "peak_rss_mib", ".0f"),
    ("Peak device memory (MiB)", "peak_device_memory_mib", ".0f"),
    ("Start-up to first token (s)", "startup_s", ".2f"),
    ("CPU", "cpu_model", ""),
    ("CPU vector ISA", "cpu_isa", ""),
    ("CPU kernels built for", "cpu_kernel_isa", ""),
    *CONTENTION_ROWS,
]


def print_latency(result: dict[str, Any]) -> None:
    shown = {**result, "input_len": f"{result['input_len']} / {result['output_len']}"}
    if "weight_bytes_per_step" in result:
        shown["weight_mib_per_step"] = result["weight_bytes_per_step"] / 2**20
    print_tables(summary_table("Latency benchmark", shown, LATENCY_ROWS),
                 latency_table(result, ("latency", "ttft", "tpot"), result["metric_percentiles"]))
