"""The one-line engine summary vLLM users know, logged every few seconds."""

from __future__ import annotations

import logging
import time

from tokenmill.metrics.stats import IterationStats, SchedulerSnapshot

logger = logging.getLogger("tokenmill.metrics")


class LoggingStatLogger:
    def __init__(self, interval_s: float = 5.0) -> None:
        self.interval_s = interval_s
        self._last = time.monotonic()
        self._prompt_tokens = 0
        self._generation_tokens = 0

    def record(self, scheduler: SchedulerSnapshot, iteration: IterationStats) -> None:
        self._prompt_tokens += iteration.num_prompt_tokens
        self._generation_tokens += iteration.num_generation_tokens
        now = time.monotonic()
        elapsed = now - self._last
        if elapsed < self.interval_s:
            return
        hit_rate = scheduler.prefix_cache_hits / scheduler.prefix_cache_queries if scheduler.prefix_cache_queries else 0.0
        logger.info(
            "prompt throughput: %.1f tok/s, generation throughput: %.1f tok/s, running: %d, waiting: %d, "
            "KV cache usage: %.1f%%, prefix cache hit rate: %.1f%%",
            self._prompt_tokens / elapsed, self._generation_tokens / elapsed, scheduler.num_running,
            scheduler.num_waiting, 100 * scheduler.kv_cache_usage, 100 * hit_rate,
        )
        self._last, self._prompt_tokens, self._generation_tokens = now, 0, 0
