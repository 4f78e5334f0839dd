"""The engines an offline benchmark can drive, behind one small interface.

``throughput`` and ``latency`` hand a backend a list of requests and get
one ``RequestRecord`` per request back; everything else (datasets, metrics,
reports) is shared, so the same command measures tokenmill and the
transformers baseline on the same workload.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import import_module
from typing import Any, Protocol

from tokenmill_cli.bench.datasets import BenchRequest
from tokenmill_cli.bench.metrics import RequestRecord
from tokenmill_cli.bench.roofline import WeightCounts


@dataclass(frozen=True)
class EngineCounters:
    """Cumulative engine counters; a run reports the difference across it."""

    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of which found there
    preemptions: int = 0
    spec_drafts: int = 0  # speculative decoding: request steps that verified drafts
    spec_draft_tokens: int = 0  # draft tokens verified
    spec_accepted_tokens: int = 0  # of which accepted
    comm_seconds: float = 0.0  # rank 0's time in its tensor-parallel collectives (Worker.communication_stats)
    comm_calls: int = 0
    step_seconds: float = 0.0  # rank 0's time in its steps (forward and sampling), which contain them
    steps: int = 0
    # Pipeline parallelism: each stage's time computing (its first rank's steps less the time they
    # were blocked on the other stages), the steps the engine core sent and how many of them it
    # sent with no other step in flight (the pipeline filling from empty: engine.micro_batches).
    stage_busy_seconds: tuple[float, ...] = ()
    micro_batches: int = 0
    pipeline_fills: int = 0
    # speculative decoding's off-switches: requests switched off for low acceptance, request steps
    # without drafts because of it, engine steps without drafts past disable_by_batch_size
    spec_paused_requests: int = 0
    spec_paused_steps: int = 0
    spec_steps_drafting_off: int = 0

    def since(self, before: EngineCounters) -> EngineCounters:
        return EngineCounters(self.prefix_queries - before.prefix_queries, self.prefix_hits - before.prefix_hits,
                              self.preemptions - before.preemptions, self.spec_drafts - before.spec_drafts,
                              self.spec_draft_tokens - before.spec_draft_tokens,
                              self.spec_accepted_tokens - before.spec_accepted_tokens,
                              self.comm_seconds - before.comm_seconds, self.comm_calls - before.comm_calls,
                              self.step_seconds - before.step_seconds, self.steps - before.steps,
                              tuple(a - b for a, b in zip(self.stage_busy_seconds, before.stage_busy_seconds,
                                                          strict=True)),
                              self.micro_batches - before.micro_batches, self.pipeline_fills - before.pipeline_fills,
                              spec_paused_requests=self.spec_paused_requests - before.spec_paused_requests,
                              spec_paused_steps=self.spec_paused_steps - before.spec_paused_steps,
                              spec_steps_drafting_off=self.spec_steps_drafting_off - before.spec_steps_drafting_off)

    def pipeline_json(self, duration: float) -> dict[str, Any]:
        """Under pipeline parallelism, over a run of ``duration`` seconds: the bubble (the share of
        the run the stages were not computing, on average over them: blocked on another stage or
        waiting for the engine), each stage's idle share, the micro-batches per fill ``m`` and the
        ideal bubble ``(pp - 1) / (m + pp - 1)`` of stages of equal time that nothing else delays
        (empty with one stage)."""
        pp = len(self.stage_busy_seconds)
        if pp < 2 or duration <= 0:
            return {}
        idle = [max(0.0, 1.0 - busy / duration) for busy in self.stage_busy_seconds]
        m = self.micro_batches / max(1, self.pipeline_fills)
        return {"pipeline_bubble_fraction": sum(idle) / pp, "pipeline_stage_idle_fractions": idle,
                "pipeline_micro_batches": self.micro_batches, "pipeline_micro_batches_per_fill": m,
                "pipeline_ideal_bubble_fraction": (pp - 1) / (m + pp - 1)}

    def communication_json(self) -> dict[str, float]:
        """Per step over a run, under tensor parallelism: the collectives' milliseconds, their
        count, and their share of the step (empty where no collective ran: one rank)."""
        if not self.comm_calls or not self.steps:
            return {}
        return {"comm_ms_per_step": 1000.0 * self.comm_seconds / self.steps,
                "comm_calls_per_step": self.comm_calls / self.steps,
                "step_ms": 1000.0 * self.step_seconds / self.steps,
                "comm_step_fraction": self.comm_seconds / self.step_seconds if self.step_seconds > 0 else 0.0}

    def spec_decode_json(self, engine_kwargs: dict[str, Any]) -> dict[str, float]:
        """Acceptance over a run, for a result's JSON (empty without a speculative_config)."""
        if engine_kwargs.get("speculative_config") is None:
            return {}
        return {"spec_decode_num_draft_tokens": self.spec_draft_tokens,
                "spec_decode_num_accepted_tokens": self.spec_accepted_tokens,
                "spec_decode_acceptance_rate": self.spec_accepted_tokens / max(1, self.spec_draft_tokens),
                "spec_decode_mean_accepted_length": 1 + self.spec_accepted_tokens / max(1, self.spec_drafts),
                "spec_decode_num_paused_requests": self.spec_paused_requests,
                "spec_decode_num_paused_steps": self.spec_paused_steps,
                "spec_decode_num_steps_drafting_off": self.spec_steps_drafting_off}

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


# the report rows of EngineCounters.communication_json (label, key, format; absent keys are skipped)
COMMUNICATION_ROWS: list[tuple[str, str, str]] = [
    ("TP collectives per step (ms, rank 0)", "comm_ms_per_step", ".3f"),
    ("TP collectives per step (calls)", "comm_calls_per_step", ".1f"),
    ("Step on rank 0 (ms)", "step_ms", ".3f"),
    ("Collectives' share of the step", "comm_step_fraction", ".1%"),
]

# the report rows of EngineCounters.pipeline_json
PIPELINE_ROWS: list[tuple[str, str, str]] = [
    ("Pipeline bubble (stages idle)", "pipeline_bubble_fraction", ".1%"),
    ("Micro-batches per pipeline fill (m)", "pipeline_micro_batches_per_fill", ".1f"),
    ("Ideal bubble (pp-1)/(m+pp-1)", "pipeline_ideal_bubble_fraction", ".1%"),
]


class Backend(Protocol):
    name: str
    tokenizer: Any
    vocab_size: int
    max_model_len: int | None
    device: Any  # a torch.device
    dtype: Any  # the torch.dtype the model runs in
    weights: WeightCounts | None

    def run(self, requests: Sequence[BenchRequest], temperature: float,
            on_finish: Callable[[], None] | None = None) -> list[RequestRecord]:
        """Generate exactly ``output_len`` tokens (EOS ignored) for every request, all
        arriving now; records come back in the requests' order."""
        ...

    def counters(self) -> EngineCounters: ...


# name -> "module:Class", imported only when chosen (the engines pull in torch)
BACKENDS: dict[str, str] = {
    "tokenmill": "tokenmill_cli.bench.tokenmill_backend:TokenmillBackend",
    "hf": "tokenmill_cli.bench.hf_backend:HFBackend",
}
# `vllm bench` defaults to --backend vllm: here that is this engine
ALIASES = {"vllm": "tokenmill"}


def canonical_backend(name: str) -> str:
    name = ALIASES.get(name, name)
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")
    return name


def create_backend(name: str, model: str | None, engine_kwargs: dict[str, Any], batch_size: int | None) -> Backend:
    """Build a backend; ``batch_size`` is the static batch of backends without continuous batching."""
    module, _, cls = BACKENDS[canonical_backend(name)].partition(":")
    backend: Backend = getattr(import_module(module), cls)(model, engine_kwargs, batch_size)
    return backend
