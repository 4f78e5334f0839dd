"""Latency metrics from per-request timestamps, with vLLM's definitions.

Each request keeps when it was sent and when each piece of its output came
(an engine step's new tokens, or one SSE chunk). From those:

- TTFT: first output - sent.
- TPOT: (last output - first output) / (output tokens - 1); requests of one
  output token have no TPOT.
- ITL: every gap between consecutive outputs, over all requests. A piece
  that carries several tokens counts as one gap, as a client sees it.
- E2E latency (``e2el``): last output - sent.

Times are ``time.perf_counter()`` seconds; reported latencies are in ms.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

DEFAULT_PERCENTILES = (90.0, 99.0)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestRecord:
    prompt_len: int
    sent: float
    output_times: list[float] = field(default_factory=list)
    output_len: int = 0  # tokens generated so far
    error: str | None = None

    def add_output(self, at: float, total_tokens: int) -> None:
        """A piece of output arrived at ``at``, bringing the count to ``total_tokens``."""
        self.output_times.append(at)
        self.output_len = total_tokens

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.output_times)

    @property
    def ttft(self) -> float:
        return self.output_times[0] - self.sent

    @property
    def e2el(self) -> float:
        return self.output_times[-1] - self.sent

    @property
    def tpot(self) -> float | None:
        if self.output_len < 2:
            return None
        return (self.output_times[-1] - self.output_times[0]) / (self.output_len - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.output_times, self.output_times[1:], strict=False)]


def parse_percentiles(text: str) -> tuple[float, ...]:
    """``"90,99"`` -> ``(90.0, 99.0)``; each in (0, 100]."""
    values = tuple(float(p) for p in text.split(",") if p.strip())
    if not values or not all(0 < p <= 100 for p in values):
        raise ValueError(f"percentiles must be numbers in (0, 100], comma separated; got {text!r}")
    return values


def percentile_key(p: float) -> str:
    return f"p{p:g}".replace(".", "_")


def summarize(values: Sequence[float], percentiles: Sequence[float] = DEFAULT_PERCENTILES,
              scale: float = 1.0) -> dict[str, float]:
    """mean, median, std and each percentile of ``values`` times ``scale`` (0 for none)."""
    data = np.asarray(values, dtype=np.float64) * scale
    if data.size == 0:
        return {"mean": 0.0, "median": 0.0, "std": 0.0, **{percentile_key(p): 0.0 for p in percentiles}}
    summary = {"mean": float(data.mean()), "median": float(np.median(data)), "std": float(data.std())}
    summary.update({percentile_key(p): float(np.percentile(data, p)) for p in percentiles})
    return summary


@dataclass
class RunMetrics:
    duration_s: float
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    latencies_ms: dict[str, dict[str, float]]  # metric -> summary
    errors: list[str]

    @property
    def request_throughput(self) -> float:
        return self.completed / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def input_throughput(self) -> float:
        return self.total_input_tokens / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def output_throughput(self) -> float:
        return self.total_output_tokens / self.duration_s if self.duration_s > 0 else 0.0

    def as_json(self) -> dict[str, Any]:
        """Flat keys, as ``vllm bench serve`` writes them (``mean_ttft_ms``, ``p99_itl_ms``, ...)."""
        out: dict[str, Any] = {
            "duration": self.duration_s,
            "completed": self.completed,
            "failed": self.failed,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "input_throughput": self.input_throughput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.input_throughput + self.output_throughput,
        }
        for metric, summary in self.latencies_ms.items():
            out.update({f"{stat}_{metric}_ms": value for stat, value in summary.items()})
        out["errors"] = self.errors
        return out


def compute_metrics(records: Sequence[RequestRecord], duration_s: float,
                    percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> RunMetrics:
    done = [r for r in records if r.ok]
    tpots = [t for r in done if (t := r.tpot) is not None]
    latencies = {
        "ttft": summarize([r.ttft for r in done], percentiles, 1000.0),
        "tpot": summarize(tpots, percentiles, 1000.0),
        "itl": summarize([gap for r in done for gap in r.itls], percentiles, 1000.0),
        "e2el": summarize([r.e2el for r in done], percentiles, 1000.0),
    }
    return RunMetrics(
        duration_s=duration_s,
        completed=len(done),
        failed=len(records) - len(done),
        total_input_tokens=sum(r.prompt_len for r in done),
        total_output_tokens=sum(r.output_len for r in done),
        latencies_ms=latencies,
        errors=[r.error for r in records if r.error is not None][:10],
    )
