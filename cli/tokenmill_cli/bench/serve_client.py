"""``tokenmill bench serve``: load on a running OpenAI-compatible server.

Requests go to ``/v1/completions`` with ``stream: true``, so each SSE chunk
is timestamped as it arrives: the first one gives TTFT, the gaps give ITL.
Token counts come from the final usage chunk (``stream_options.include_usage``)
where the server sends one, else from the number of chunks with text.

Arrivals: ``--request-rate`` requests per second with gamma-distributed gaps
of shape ``--burstiness`` (1 is a Poisson process; below 1 burstier, above
more regular), or all at once for ``inf``. ``--max-concurrency`` caps the
requests in flight; a request's clock starts when it is actually sent.
Arrival times are planned from the start, so sleeps do not drift.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from tokenmill_cli.bench.contention import CONTENTION_ROWS
from tokenmill_cli.bench.datasets import BenchRequest
from tokenmill_cli.bench.metrics import LATENCY_METRICS, RequestRecord, compute_metrics
from tokenmill_cli.bench.report import Row, latency_table, print_tables, summary_table

_REQUEST_TIMEOUT_S = 6 * 3600.0  # a long run under heavy load is not an error


@dataclass(frozen=True)
class ServeOptions:
    base_url: str  # e.g. http://127.0.0.1:8000
    endpoint: str = "/v1/completions"
    model: str | None = None  # the served name; None: the server's first model
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    api_key: str | None = None
    seed: int = 0
    lora_models: tuple[str, ...] = ()  # adapter names the requests are spread over, round robin (bench --lora)


def arrival_offsets(count: int, rate: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    """When each request is due, in seconds from the start; the first is due at once."""
    if burstiness <= 0:
        raise ValueError("--burstiness must be positive")
    if rate <= 0:
        raise ValueError("--request-rate must be positive (inf: all at once)")
    if math.isinf(rate) or count == 0:
        return [0.0] * count
    # gamma(shape k, scale 1/(rate k)) has mean 1/rate whatever k; k = 1 is exponential (Poisson)
    gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), size=count - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


async def check_server(client: httpx.AsyncClient, base_url: str, model: str | None) -> str:
    """Fail early if nothing answers at ``base_url``; returns the model name to request
    (``model``, else the first one ``/v1/models`` lists)."""
    try:
        response = await client.get(f"{base_url}/v1/models")
    except httpx.TransportError as exc:
        raise ConnectionError(f"cannot reach the server at {base_url}: {exc}") from exc
    if model is not None:
        return model  # a server without /v1/models is fine when the name is given
    if response.status_code != 200:
        raise ConnectionError(f"{base_url}/v1/models answered {response.status_code}; pass --model")
    models = response.json().get("data") or []
    if not models:
        raise ConnectionError(f"{base_url}/v1/models lists no model; pass --model")
    return str(models[0]["id"])


def request_payload(request: BenchRequest, model: str, opts: ServeOptions) -> dict[str, Any]:
    """Token ids as the prompt (exact lengths) unless the dataset started from text."""
    payload: dict[str, Any] = {
        "model": model,
        "prompt": request.prompt if request.prompt is not None else request.prompt_token_ids,
        "max_tokens": request.output_len,
        "temperature": opts.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if opts.ignore_eos:
        payload["ignore_eos"] = True  # vLLM's extension, which tokenmill's server shares
    return payload


async def send_request(client: httpx.AsyncClient, url: str, payload: dict[str, Any], prompt_len: int) -> RequestRecord:
    record = RequestRecord(prompt_len, time.perf_counter())
    usage: dict[str, Any] | None = None
    chunks = 0
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {body[:300]}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = str(chunk["error"])
                    break
                usage = chunk.get("usage") or usage
                if any(choice.get("text") for choice in chunk.get("choices") or []):
                    chunks += 1
                    record.add_output(time.perf_counter(), chunks)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    if usage is not None and record.output_times:  # the server's count beats the chunk count
        record.output_len = int(usage.get("completion_tokens", record.output_len))
        record.prompt_len = int(usage.get("prompt_tokens", record.prompt_len))
    return record


async def run_requests(requests: Sequence[BenchRequest], opts: ServeOptions,
                       on_finish: Callable[[], None] | None = None) -> tuple[list[RequestRecord], float, str]:
    """Send every request on its schedule; returns the records, the duration and the model name."""
    base_url = opts.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    offsets = arrival_offsets(len(requests), opts.request_rate, opts.burstiness, np.random.default_rng(opts.seed))
    limits = httpx.Limits(max_connections=opts.max_concurrency, max_keepalive_connections=opts.max_concurrency)
    gate = asyncio.Semaphore(opts.max_concurrency) if opts.max_concurrency else None
    async with httpx.AsyncClient(timeout=_REQUEST_TIMEOUT_S, limits=limits, headers=headers) as client:
        model = await check_server(client, base_url, opts.model)
        url = base_url + opts.endpoint

        async def one(index: int, request: BenchRequest) -> RequestRecord:
            name = opts.lora_models[index % len(opts.lora_models)] if opts.lora_models else model
            payload = request_payload(request, name, opts)
            if gate is None:
                record = await send_request(client, url, payload, request.prompt_len)
            else:
                async with gate:
                    record = await send_request(client, url, payload, request.prompt_len)
            if on_finish is not None:
                on_finish()
            return record

        start = time.perf_counter()
        tasks = []
        for index, (request, offset) in enumerate(zip(requests, offsets, strict=True)):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(index, request)))
        records = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
    return records, duration, model


def run_serve(requests: Sequence[BenchRequest], opts: ServeOptions, dataset_name: str,
              percentiles: Sequence[float], disable_tqdm: bool = False) -> dict[str, Any]:
    from tqdm import tqdm

    bar = tqdm(total=len(requests), desc="Serve", unit=" req", disable=disable_tqdm)
    try:
        records, duration, model = asyncio.run(run_requests(requests, opts, on_finish=lambda: bar.update(1)))
    finally:
        bar.close()
    metrics = compute_metrics(records, duration, percentiles)
    return {
        "benchmark": "serve",
        "backend": "openai",
        "base_url": opts.base_url,
        "endpoint": opts.endpoint,
        "model": model,
        "lora_models": list(opts.lora_models),
        "dataset_name": dataset_name,
        "num_prompts": len(requests),
        "request_rate": "inf" if math.isinf(opts.request_rate) else opts.request_rate,
        "burstiness": opts.burstiness,
        "max_concurrency": opts.max_concurrency,
        "metric_percentiles": list(percentiles),
        **metrics.as_json(),
    }


SERVE_ROWS: list[Row] = [
    ("Server", "base_url", ""),
    ("Model", "model", ""),
    ("Dataset", "dataset_name", ""),
    ("Request rate (req/s)", "request_rate", ".2f"),
    ("Max concurrency", "max_concurrency", "d"),
    ("Successful requests", "completed", "d"),
    ("Failed requests", "failed", "d"),
    ("Benchmark duration (s)", "duration", ".2f"),
    ("Total input tokens", "total_input_tokens", "d"),
    ("Total generated tokens", "total_output_tokens", "d"),
    ("Request throughput (req/s)", "request_throughput", ".2f"),
    ("Input token throughput (tok/s)", "input_throughput", ".1f"),
    ("Output token throughput (tok/s)", "output_throughput", ".1f"),
    ("Total token throughput (tok/s)", "total_token_throughput", ".1f"),
    *CONTENTION_ROWS,  # --background-load
]


def print_serve(result: dict[str, Any], metrics: Sequence[str] = LATENCY_METRICS) -> None:
    print_tables(summary_table("Serving benchmark", result, SERVE_ROWS),
                 latency_table(result, metrics, result["metric_percentiles"]))
