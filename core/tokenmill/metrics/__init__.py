"""Engine statistics: what each step and each finished request measured, and
the loggers (a periodic log line, Prometheus) that consume them."""

from tokenmill.metrics.stats import FinishedRequestStats, IterationStats, RequestTimer, SchedulerSnapshot, StatLogger

__all__ = ["FinishedRequestStats", "IterationStats", "RequestTimer", "SchedulerSnapshot", "StatLogger"]
