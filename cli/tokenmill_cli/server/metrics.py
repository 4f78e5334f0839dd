"""``GET /metrics``: the engine's Prometheus metrics and the server's own (admission rejections).

Each app has its own registry, so several apps in one process (tests) never
collide. When ``PROMETHEUS_MULTIPROC_DIR`` is set, prometheus_client keeps every
value in per-process files in that folder, and a scrape of any process merges
all of them (counters and histograms add up; gauges follow the mode each was
declared with); a process marks its live gauges dead when it shuts down. The
folder must exist, be empty at the first start, and be shared by the processes.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from fastapi import APIRouter
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, ProcessCollector, generate_latest
from starlette.responses import Response

from tokenmill.metrics.logging_logger import LoggingStatLogger
from tokenmill.metrics.prometheus import PrometheusStatLogger
from tokenmill_cli.server.settings import ServerSettings
from tokenmill_cli.server.state import State

if TYPE_CHECKING:
    from tokenmill.entrypoints.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
REJECT_REASONS = ("max_queued_requests", "max_queued_tokens", "shutting_down")

router = APIRouter(tags=["operations"])


def multiprocess_dir() -> str | None:
    return os.environ.get(MULTIPROC_ENV) or os.environ.get(MULTIPROC_ENV.lower()) or None


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.multiprocess = multiprocess_dir() is not None
        self.registry = CollectorRegistry()
        if not self.multiprocess:  # per-process figures cannot be merged across processes
            ProcessCollector(registry=self.registry)
        self.rejected = Counter("tokenmill:num_requests_rejected",
                                "Requests refused at admission (queue bounds, or the server shutting down)",
                                ["model_name", "reason"], registry=self.registry)
        for reason in REJECT_REASONS:  # present from the start, at zero
            self.rejected.labels(model_name, reason)

    def attach(self, engine: AsyncLLM, settings: ServerSettings) -> None:
        """Give the engine its stat loggers (Prometheus, the periodic log line); count its refusals."""
        engine.admission.on_reject = self.reject
        if settings.enable_metrics:
            engine.add_stat_logger(PrometheusStatLogger(self.model_name, self.registry))
            # read where the engine steps, at most every 10 s and when it goes idle (an engine in its
            # own process sends them with its stats); a model without experts stops it at once
            engine.add_expert_load_logger(self.model_name, self.registry)
        if settings.log_stats:
            engine.add_stat_logger(LoggingStatLogger(settings.log_stats_interval))

    def reject(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    def exposition(self) -> bytes:
        if not self.multiprocess:
            return generate_latest(self.registry)
        from prometheus_client import multiprocess

        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged)
        return generate_latest(merged)

    def close(self) -> None:
        if self.multiprocess:
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(os.getpid())


@router.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
async def metrics(state: State) -> Response:
    """Prometheus text format; names are prefixed ``tokenmill:`` and labelled with the model name."""
    return Response(state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
