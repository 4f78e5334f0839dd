"""``tokenmill bench throughput``: the offline engine over a whole dataset.

Every request arrives at once (as ``LLM.generate`` receives a list), EOS
is ignored so each generates exactly its ``output_len``, and the clock runs
from the first request added to the last token out. TTFT therefore includes
the time a request waited for a batch slot, as in ``vllm bench throughput``.
One short untimed request runs first; its first token marks start-up.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from tokenmill_cli.bench.backends import COMMUNICATION_ROWS, PIPELINE_ROWS, canonical_backend, create_backend
from tokenmill_cli.bench.background_load import background_load
from tokenmill_cli.bench.contention import CONTENTION_ROWS, contention_json, result_figures
from tokenmill_cli.bench.datasets import (
    BenchRequest,
    DatasetContext,
    DatasetOptions,
    Vocabulary,
    canonical_name,
    load_dataset,
)
from tokenmill_cli.bench.expert_load import EXPERT_LOAD_ROWS, backend_expert_loads, expert_load_json
from tokenmill_cli.bench.metrics import DEFAULT_PERCENTILES, LATENCY_METRICS, RequestRecord, compute_metrics
from tokenmill_cli.bench.report import Row, latency_table, print_tables, summary_table
from tokenmill_cli.bench.roofline import roofline_json, useful_flops
from tokenmill_cli.bench.stat_loggers import attach_stat_loggers, stat_logging_seconds
from tokenmill_cli.bench.structured import compare, compile_grammar, constrain, ms_per_output_token
from tokenmill_cli.bench.system import (
    cpu_json,
    cpu_kernels_json,
    measure_peak_gflops,
    memory_json,
    process_start_time,
    startup_seconds,
)

WARMUP_PROMPT_LEN, WARMUP_OUTPUT_LEN = 8, 2


@dataclass(frozen=True)
class ThroughputOptions:
    backend: str = "tokenmill"
    hf_batch_size: int = 1
    temperature: float = 1.0  # vLLM's throughput benchmark samples at temperature 1
    peak_gflops: float | None = None  # None: measure it
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    disable_tqdm: bool = False
    structured_output: str = "none"  # a constraint kind of bench.structured, applied to every request
    compare_structured_rounds: int = 0  # > 0: run plain and constrained this many times each, report both
    disable_log_stats: bool = False  # no Prometheus logger and log line on the engine (the server has both)
    background_load: int = 0  # > 0: run quiet, then beside this many busy processes (bench.background_load)
    background_kind: str = "matmul"
    lora_paths: tuple[str, ...] = ()  # LoRA adapters the requests are spread over, round robin


def run_throughput(model: str | None, engine_kwargs: dict[str, Any], dataset: DatasetOptions,
                   opts: ThroughputOptions) -> dict[str, Any]:
    process_start = process_start_time()
    backend_name = canonical_backend(opts.backend)
    backend = create_backend(backend_name, model, engine_kwargs, opts.hf_batch_size)
    log_stats = not opts.disable_log_stats and attach_stat_loggers(backend, model or "default")
    dataset = replace(dataset, name=canonical_name(dataset.name), max_model_len=backend.max_model_len)
    vocab = Vocabulary.from_tokenizer(backend.tokenizer, backend.vocab_size)
    requests = load_dataset(dataset, DatasetContext(backend.tokenizer, vocab))
    warmup = backend.run([_warmup_request(vocab, dataset.seed)], opts.temperature)
    if opts.compare_structured_rounds:
        kind = "json-schema" if opts.structured_output == "none" else opts.structured_output
        return {**compare(backend, requests, kind, opts.temperature, opts.compare_structured_rounds),
                "backend": backend_name, "model": model, "dataset_name": dataset.name, "num_prompts": len(requests),
                "engine_args": engine_kwargs}
    requests = constrain(requests, opts.structured_output)
    if opts.lora_paths:
        requests = [replace(r, lora_path=opts.lora_paths[i % len(opts.lora_paths)]) for i, r in enumerate(requests)]
    compile_grammar(backend, requests, opts.temperature)
    startup_s = startup_seconds(_first_token(warmup), process_start)

    quiet = None
    if opts.background_load:  # the same workload on the quiet machine first, to compare against
        quiet_records, quiet_duration, _, _ = _timed_run(backend, requests, opts)
        quiet = compute_metrics(quiet_records, quiet_duration, opts.percentiles).as_json()
    loads_before = backend_expert_loads(backend)
    with background_load(opts.background_load, opts.background_kind):
        records, duration, counters, stat_logging_s = _timed_run(backend, requests, opts)
    expert_load = expert_load_json(loads_before, backend_expert_loads(backend))
    memory = memory_json()  # before the peak measurement's matrices can raise the peaks
    # Measured after the run, not before: start-up work still running in the background
    # (the CPU platform's KV prefault) would share the cores and understate the peak.
    peak, peak_source = ((opts.peak_gflops, "--peak-gflops") if opts.peak_gflops
                         else (measure_peak_gflops(backend.device, backend.dtype), "measured"))

    metrics = compute_metrics(records, duration, opts.percentiles)
    result: dict[str, Any] = {
        "benchmark": "throughput",
        "backend": backend_name,
        "model": model,
        "device": str(backend.device),
        "dataset_name": dataset.name,
        "num_prompts": len(requests),
        "structured_output": opts.structured_output,
        "ms_per_output_token": ms_per_output_token(duration, records),
        "hf_batch_size": opts.hf_batch_size if backend_name == "hf" else None,
        "metric_percentiles": list(opts.percentiles),
        **metrics.as_json(),
        # `vllm bench throughput`'s own keys, for scripts that read them
        "elapsed_time": duration,
        "num_requests": metrics.completed,
        "total_num_tokens": metrics.total_input_tokens + metrics.total_output_tokens,
        "requests_per_second": metrics.request_throughput,
        "tokens_per_second": metrics.input_throughput + metrics.output_throughput,
        "prefix_cache_queries": counters.prefix_queries,
        "prefix_cache_hits": counters.prefix_hits,
        "prefix_cache_hit_rate": counters.prefix_hit_rate,
        "num_preemptions": counters.preemptions,
        **counters.spec_decode_json(engine_kwargs),
        **expert_load,
        **counters.communication_json(),
        **counters.pipeline_json(duration),
        **memory,
        "startup_s": startup_s,
        "engine_args": engine_kwargs,
        "log_stats": log_stats,
        "stat_logging_s": stat_logging_s,
        "stat_logging_fraction": stat_logging_s / duration if stat_logging_s is not None and log_stats else None,
        **cpu_json(),
        **cpu_kernels_json(),
        **contention_json(opts.background_load, opts.background_kind, result_figures(metrics.as_json()), quiet),
    }
    if backend.weights is not None:
        flops = useful_flops(backend.weights, records, counters.prefix_hits)
        roofline = roofline_json(flops, duration, peak, peak_source)
        result.update({"weights_body": backend.weights.body, "weights_lm_head": backend.weights.lm_head,
                       "useful_flops": flops, "achieved_gflops": roofline["achieved_gflops"],
                       "peak_gflops": peak, "peak_gflops_source": peak_source,
                       "roofline_fraction": roofline["fraction"]})
    return result


def _timed_run(backend: Any, requests: Sequence[BenchRequest],
               opts: ThroughputOptions) -> tuple[list[RequestRecord], float, Any, float | None]:
    """The workload once, timed: its records, duration, engine counters and time in stat logging."""
    before = backend.counters()
    logging_before = stat_logging_seconds(backend)
    bar = _progress(len(requests), opts.disable_tqdm)
    start = time.perf_counter()
    records = backend.run(requests, opts.temperature, on_finish=lambda: bar.update(1))
    duration = time.perf_counter() - start
    bar.close()
    counters = backend.counters().since(before)
    logging_after = stat_logging_seconds(backend)
    stat_logging_s = None if logging_before is None or logging_after is None else logging_after - logging_before
    return list(records), duration, counters, stat_logging_s


def _warmup_request(vocab: Vocabulary, seed: int) -> BenchRequest:
    """One short request, untimed: first-call costs (allocator, thread pools, lazy
    initialisation) belong to start-up, which its first token measures."""
    return BenchRequest(vocab.sample(np.random.default_rng(seed + 1), WARMUP_PROMPT_LEN), WARMUP_OUTPUT_LEN)


def _first_token(records: Sequence[RequestRecord]) -> float | None:
    firsts = [r.output_times[0] for r in records if r.output_times]
    return min(firsts) if firsts else None


def _progress(total: int, disable: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="Throughput", unit=" req", disable=disable)


THROUGHPUT_ROWS: list[Row] = [
    ("Backend", "backend", ""),
    ("Dataset", "dataset_name", ""),
    ("Structured output", "structured_output", ""),
    ("Successful requests", "completed", "d"),
    ("Failed requests", "failed", "d"),
    ("Benchmark duration (s)", "duration", ".2f"),
    ("Total input tokens", "total_input_tokens", "d"),
    ("Total generated tokens", "total_output_tokens", "d"),
    ("Request throughput (req/s)", "request_throughput", ".2f"),
    ("Input token throughput (tok/s)", "input_throughput", ".1f"),
    ("Output token throughput (tok/s)", "output_throughput", ".1f"),
    ("Total token throughput (tok/s)", "total_token_throughput", ".1f"),
    ("ms per output token", "ms_per_output_token", ".3f"),
    ("Prefix cache hit rate", "prefix_cache_hit_rate", ".1%"),
    ("Preemptions", "num_preemptions", "d"),
    ("Draft acceptance rate", "spec_decode_acceptance_rate", ".1%"),
    ("Mean accepted length", "spec_decode_mean_accepted_length", ".2f"),
    ("Requests switched off (low acceptance)", "spec_decode_num_paused_requests", "d"),
    ("Request steps without drafts (switched off)", "spec_decode_num_paused_steps", "d"),
    ("Steps without drafts (batch too large)", "spec_decode_num_steps_drafting_off", "d"),
    *EXPERT_LOAD_ROWS,
    *COMMUNICATION_ROWS,
    *PIPELINE_ROWS,
    ("Time in stat logging", "stat_logging_fraction", ".2%"),
    ("Achieved GFLOP/s (useful)", "achieved_gflops", ".2f"),
    ("Peak GFLOP/s", "peak_gflops", ".1f"),
    ("Roofline fraction", "roofline_fraction", ".2%"),
    ("Peak RSS (MiB)", "peak_rss_mib", ".0f"),
    ("Peak device memory (MiB)", "peak_device_memory_mib", ".0f"),
    ("Start-up to first token (s)", "startup_s", ".2f"),
    ("CPU", "cpu_model", ""),
    ("CPU vector ISA", "cpu_isa", ""),
    ("CPU kernels built for", "cpu_kernel_isa", ""),
    *CONTENTION_ROWS,
]


def print_throughput(result: dict[str, Any]) -> None:
    print_tables(summary_table("Throughput benchmark", result, THROUGHPUT_ROWS),
                 latency_table(result, LATENCY_METRICS, result["metric_percentiles"]))
