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

from tokenmill_cli.bench.backends import canonical_backend, create_backend
from tokenmill_cli.bench.datasets import (
    BenchRequest,
    DatasetContext,
    DatasetOptions,
    Vocabulary,
    canonical_name,
    load_dataset,
)
from tokenmill_cli.bench.metrics import DEFAULT_PERCENTILES, LATENCY_METRICS, RequestRecord, compute_metrics
from tokenmill_cli.bench.report import Row, latency_table, print_tables, summary_table
from tokenmill_cli.bench.roofline import roofline_json, useful_flops
from tokenmill_cli.bench.system import measure_peak_gflops, memory_json, process_start_time, startup_seconds

WARMUP_PROMPT_LEN, WARMUP_OUTPUT_LEN = 8, 2


@dataclass(frozen=True)
class ThroughputOptions:
    backend: str = "tokenmill"
    hf_batch_size: int = 1
    temperature: float = 1.0  # vLLM's throughput benchmark samples at temperature 1
    peak_gflops: float | None = None  # None: measure it
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    disable_tqdm: bool = False


def run_throughput(model: str | None, engine_kwargs: dict[str, Any], dataset: DatasetOptions,
                   opts: ThroughputOptions) -> dict[str, Any]:
    process_start = process_start_time()
    backend_name = canonical_backend(opts.backend)
    backend = create_backend(backend_name, model, engine_kwargs, opts.hf_batch_size)
    dataset = replace(dataset, name=canonical_name(dataset.name), max_model_len=backend.max_model_len)
    vocab = Vocabulary.from_tokenizer(backend.tokenizer, backend.vocab_size)
    requests = load_dataset(dataset, DatasetContext(backend.tokenizer, vocab))
    warmup = backend.run([_warmup_request(vocab, dataset.seed)], opts.temperature)
    startup_s = startup_seconds(_first_token(warmup), process_start)
    peak, peak_source = ((opts.peak_gflops, "--peak-gflops") if opts.peak_gflops
                         else (measure_peak_gflops(backend.device), "measured"))

    before = backend.counters()
    bar = _progress(len(requests), opts.disable_tqdm)
    start = time.perf_counter()
    records = backend.run(requests, opts.temperature, on_finish=lambda: bar.update(1))
    duration = time.perf_counter() - start
    bar.close()
    counters = backend.counters().since(before)

    metrics = compute_metrics(records, duration, opts.percentiles)
    result: dict[str, Any] = {
        "benchmark": "throughput",
        "backend": backend_name,
        "model": model,
        "device": str(backend.device),
        "dataset_name": dataset.name,
        "num_prompts": len(requests),
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
        **memory_json(),
        "startup_s": startup_s,
        "engine_args": engine_kwargs,
    }
    if backend.weights is not None:
        flops = useful_flops(backend.weights, records, counters.prefix_hits)
        roofline = roofline_json(flops, duration, peak, peak_source)
        result.update({"weights_body": backend.weights.body, "weights_lm_head": backend.weights.lm_head,
                       "useful_flops": flops, "achieved_gflops": roofline["achieved_gflops"],
                       "peak_gflops": peak, "peak_gflops_source": peak_source,
                       "roofline_fraction": roofline["fraction"]})
    return result


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
    ("Successful requests", "completed", "d"),
    ("Failed requests", "failed", "d"),
    ("Benchmark duration (s)", "duration", ".2f"),
    ("Total input tokens", "total_input_tokens", "d"),
    ("Total generated tokens", "total_output_tokens", "d"),
    ("Request throughput (req/s)", "request_throughput", ".2f"),
    ("Input token throughput (tok/s)", "input_throughput", ".1f"),
    ("Output token throughput (tok/s)", "output_throughput", ".1f"),
    ("Total token throughput (tok/s)", "total_token_throughput", ".1f"),
    ("Prefix cache hit rate", "prefix_cache_hit_rate", ".1%"),
    ("Preemptions", "num_preemptions", "d"),
    ("Achieved GFLOP/s (useful)", "achieved_gflops", ".2f"),
    ("Peak GFLOP/s", "peak_gflops", ".1f"),
    ("Roofline fraction", "roofline_fraction", ".2%"),
    ("Peak RSS (MiB)", "peak_rss_mib", ".0f"),
    ("Peak device memory (MiB)", "peak_device_memory_mib", ".0f"),
    ("Start-up to first token (s)", "startup_s", ".2f"),
]


def print_throughput(result: dict[str, Any]) -> None:
    print_tables(summary_table("Throughput benchmark", result, THROUGHPUT_ROWS),
                 latency_table(result, LATENCY_METRICS, result["metric_percentiles"]))
