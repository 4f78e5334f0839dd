"""Expert load of mixture-of-experts models: tokens routed to each expert, per MoE layer.

Every :class:`tokenmill.layers.FusedMoE` counts its routed tokens on the device (one
bincount a step, ``expert_load``); reading them costs a device sync and, with several
ranks, one round trip to every worker, so nothing reads them per step.
:func:`engine_expert_loads` reads them once (from the engine's thread, between steps);
:class:`ExpertLoadStatLogger` does so at most every ``interval_s`` for Prometheus, and
``tokenmill bench throughput`` before and after its run.

The counters only ever grow (readers here take differences, never reset them), so several
readers never take counts from each other.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

from tokenmill.layers.moe import load_imbalance
from tokenmill.metrics.stats import IterationStats, SchedulerSnapshot

ExpertLoads = dict[str, list[int]]  # MoE layer prefix -> tokens routed to each of its experts


def worker_expert_loads(worker: Any) -> ExpertLoads:
    """On a worker (through ``collective_rpc``): its model's counters, read without a reset."""
    from tokenmill.layers import expert_load_by_layer

    return expert_load_by_layer(worker.runner.model)


def engine_expert_loads(engine: Any) -> ExpertLoads:
    """The counters of ``engine``'s (an ``LLMEngine``) model, every rank's merged: tensor-
    parallel ranks route alike (the first answer is kept), pipeline stages hold different
    layers. Empty for a model without MoE layers. Call it from the engine's thread."""
    loads: ExpertLoads = {}
    for rank_loads in engine.core.executor.collective_rpc(worker_expert_loads):
        for layer, load in rank_loads.items():
            loads.setdefault(layer, load)
    return loads


def worker_expert_replicas(worker: Any) -> ExpertLoads:
    """On a worker: copies of each logical expert per MoE layer, under expert-parallel load
    balancing (empty without it)."""
    from tokenmill.eplb.rebalance import replicas_by_layer

    return replicas_by_layer(worker.runner.model)


def engine_expert_replicas(engine: Any) -> ExpertLoads:
    """Copies of each logical expert per MoE layer of ``engine``'s model (``enable_eplb``: the ranks
    agree, the first answer is kept); empty, and no round trip to the workers, without the balancer."""
    if not engine.core.config.enable_eplb:
        return {}
    replicas: ExpertLoads = {}
    for rank_replicas in engine.core.executor.collective_rpc(worker_expert_replicas):
        for layer, counts in rank_replicas.items():
            replicas.setdefault(layer, counts)
    return replicas


def loads_since(after: ExpertLoads, before: ExpertLoads) -> ExpertLoads:
    """Tokens each expert got between two reads."""
    return {layer: [n - m for n, m in zip(load, before.get(layer, [0] * len(load)), strict=True)]
            for layer, load in after.items()}


class ExpertLoadReads:
    """When to read the counters (``read``: :func:`engine_expert_loads` of the engine): on the
    first step, then at most every ``interval_s``, and on the step that leaves the engine idle
    (so a scrape after a burst sees all of it); never again once a read found no MoE layer.
    Runs where the engine steps: its thread, or its own process (which sends what it read with
    its stats, ``IterationStats.expert_loads``)."""

    def __init__(self, read: Callable[[], ExpertLoads], interval_s: float = 10.0,
                 read_replicas: Callable[[], ExpertLoads] | None = None) -> None:
        self.read = read
        # expert-parallel load balancing's copies per expert (engine_expert_replicas), read with the loads
        self.read_replicas = read_replicas
        self.replicas: ExpertLoads = {}
        self.interval_s = interval_s
        self._next_read = 0.0  # the first step reads
        self._enabled = True

    def poll(self, scheduler: SchedulerSnapshot) -> ExpertLoads | None:
        """The counters if it is time to read them, else None."""
        now = time.monotonic()
        idle = scheduler.num_running == 0 and scheduler.num_waiting == 0
        if not self._enabled or (now < self._next_read and not idle):
            return None
        self._next_read = now + self.interval_s
        loads = self.read()
        if not loads:
            self._enabled = False
            return None
        if self.read_replicas is not None:
            self.replicas = self.read_replicas()
        return loads


class ExpertLoadStatLogger:
    """Prometheus series of the expert load, refreshed at most every ``interval_s``:

    * ``tokenmill:moe_expert_tokens_total{layer, expert}``: tokens routed to the expert
      (a counter: layers x experts series, 256 a layer for DeepSeek-V3);
    * ``tokenmill:moe_expert_load_imbalance{layer}``: max over mean tokens per expert over
      the last interval that routed any.
    * ``tokenmill:moe_expert_replicas{layer, expert}``: copies of the expert under expert-parallel
      load balancing (``enable_eplb`` only: no series without it), as of the
      last read: they change when the balancer rebalances.

    ``read`` returns the current counters (:func:`engine_expert_loads` of the engine), read
    when :class:`ExpertLoadReads` says; a model whose first read finds no MoE layer is not
    read again. ``read=None``: the counters come with the records instead
    (``IterationStats.expert_loads``, filled by an engine in its own process). ``read_replicas``:
    the copies per expert (:func:`engine_expert_replicas`), read along with the counters (with
    ``read=None`` they come as ``IterationStats.expert_replicas``)."""

    def __init__(self, read: Callable[[], ExpertLoads] | None, model_name: str,
                 registry: CollectorRegistry = REGISTRY, interval_s: float = 10.0,
                 read_replicas: Callable[[], ExpertLoads] | None = None) -> None:
        self.reads = ExpertLoadReads(read, interval_s, read_replicas) if read is not None else None
        self.model = model_name
        mode: Literal["livemax"] = "livemax"
        self.tokens = Counter("tokenmill:moe_expert_tokens", "Tokens routed to each expert, per MoE layer",
                              ["model_name", "layer", "expert"], registry=registry)
        self.imbalance = Gauge("tokenmill:moe_expert_load_imbalance",
                               "Max over mean tokens per expert in the last interval, per MoE layer",
                               ["model_name", "layer"], registry=registry, multiprocess_mode=mode)
        self.replicas = Gauge("tokenmill:moe_expert_replicas",
                              "Copies of each expert under expert-parallel load balancing, per MoE layer",
                              ["model_name", "layer", "expert"], registry=registry, multiprocess_mode=mode)
        self._last: ExpertLoads = {}

    def record(self, scheduler: SchedulerSnapshot, iteration: IterationStats) -> None:
        loads = self.reads.poll(scheduler) if self.reads is not None else iteration.expert_loads
        if loads:
            self._publish(loads)
            self._publish_replicas(self.reads.replicas if self.reads is not None else iteration.expert_replicas)

    def _publish_replicas(self, replicas: ExpertLoads | None) -> None:
        for layer, counts in (replicas or {}).items():
            for expert, copies in enumerate(counts):
                self.replicas.labels(self.model, layer, str(expert)).set(copies)

    def _publish(self, loads: ExpertLoads) -> None:
        for layer, load in loads_since(loads, self._last).items():
            for expert, tokens in enumerate(load):
                if tokens > 0:
                    self.tokens.labels(self.model, layer, str(expert)).inc(tokens)
            if sum(load):
                self.imbalance.labels(self.model, layer).set(load_imbalance(load))
        self._last = loads
