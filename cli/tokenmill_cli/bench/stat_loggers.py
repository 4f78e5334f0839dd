"""The server's stat loggers on a benchmarked engine, so a run can measure what metrics cost.

``tokenmill serve`` gives its engine a Prometheus logger and the periodic log line;
``bench throughput`` does the same unless ``--disable-log-stats`` (as ``vllm bench``),
so "metrics on" and "metrics off" are one flag apart on the same workload. The engine
also times its statistics recording, which measures their cost without the noise of
comparing two runs.
"""

from __future__ import annotations

from typing import Any


def attach_stat_loggers(backend: Any, model_name: str) -> bool:
    """Give the backend's engine the server's loggers; False for backends without one (hf)."""
    llm = getattr(backend, "llm", None)
    if llm is None:
        return False
    from prometheus_client import CollectorRegistry

    from tokenmill.metrics.expert_load import ExpertLoadStatLogger, engine_expert_loads
    from tokenmill.metrics.logging_logger import LoggingStatLogger
    from tokenmill.metrics.prometheus import PrometheusStatLogger

    # a private registry: nothing is exported, but every value is recorded as a server records it
    registry = CollectorRegistry()
    llm.engine.stat_loggers.extend([PrometheusStatLogger(model_name, registry), LoggingStatLogger(),
                                    ExpertLoadStatLogger(lambda: engine_expert_loads(llm.engine), model_name, registry)])
    return True


def stat_logging_seconds(backend: Any) -> float | None:
    """Seconds the backend's engine has spent recording statistics, or None without an engine."""
    llm = getattr(backend, "llm", None)
    return None if llm is None else float(llm.engine.stat_logging_seconds)
