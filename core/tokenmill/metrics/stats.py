"""Per-step and per-request measurements.

The output processor keeps one :class:`RequestTimer` per core request and
turns the engine's outputs into one :class:`IterationStats` per step;
loggers receive it with a :class:`SchedulerSnapshot` of the queues and cache.
Times are ``time.monotonic()`` seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class SchedulerSnapshot:
    """The queues and the KV cache after a step, as the scheduler saw them (``Scheduler.make_stats``).

    The engine core returns one with each step's outputs, so the front end reads these
    numbers from it instead of from the scheduler's live lists.
    """

    num_running: int = 0
    num_waiting: int = 0
    num_waiting_for_grammar: int = 0  # structured-output requests whose grammar still compiles
    kv_cache_usage: float = 0.0
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    num_preemptions: int = 0  # since start
    prefix_cache_queries: int = 0  # tokens looked up, since start
    prefix_cache_hits: int = 0  # tokens found, since start
    encoder_cache_queries: int = 0  # multimodal items looked up in the encoder cache, since start
    encoder_cache_hits: int = 0  # of those, found (not encoded again)
    encoder_input_tokens: int = 0  # encoder input tokens (image placeholder rows) scheduled to encode, since start
    # prefill chunks cut short or held back because an item fit neither the step's encoder budget
    # nor the encoder cache, since start (scheduler/encoder_budget.py)
    encoder_budget_deferrals: int = 0
    spec_decode_num_drafts: int = 0  # requests' steps that verified drafts, since start
    spec_decode_num_draft_tokens: int = 0  # draft tokens verified, since start
    spec_decode_num_accepted_tokens: int = 0  # of those, accepted, since start
    spec_decode_accepted_per_position: tuple[int, ...] = ()  # accepted at draft position 0, 1, ... since start
    # the off-switch, since start: requests switched off for low acceptance (once per low judgement),
    # request steps without drafts because of it, steps without drafts because of disable_by_batch_size
    spec_decode_num_paused_requests: int = 0
    spec_decode_num_paused_steps: int = 0
    spec_decode_num_steps_drafting_off: int = 0

    @property
    def spec_decode_mean_accepted_length(self) -> float:
        """Tokens each verifying step gave a request on average: the accepted drafts and one more."""
        if not self.spec_decode_num_drafts:
            return 0.0
        return 1 + self.spec_decode_num_accepted_tokens / self.spec_decode_num_drafts
    # LoRA: requests waiting for their adapter, adapters in device slots / host memory, each
    # resident adapter's requests (name, count; at most max_loras of them), every load's seconds
    num_waiting_for_lora: int = 0
    lora_adapters_in_slots: int = 0
    lora_adapters_in_host: int = 0
    lora_requests: tuple[tuple[str, int], ...] = ()
    lora_load_seconds: tuple[float, ...] = ()  # since start
    # KV connector: requests whose prompt KV is being loaded; prompt tokens loaded through it (since
    # start), which a prefix-cache lookup on the device missed: external prefix-cache hits
    num_waiting_for_remote_kvs: int = 0
    prefix_cache_external_hits: int = 0


@dataclass
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float
    queue_time: float
    prefill_time: float
    decode_time: float
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass
class IterationStats:
    """What one engine step did."""

    num_prompt_tokens: int = 0  # prompt tokens computed this step
    num_generation_tokens: int = 0  # tokens sampled this step
    num_scheduled_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    num_aborted: int = 0
    # MoE layer -> tokens routed to each expert, since start: filled only by an engine in its own
    # process, when it read its counters this step (``ExpertLoadReads``), to carry them to the API side
    expert_loads: dict[str, list[int]] | None = None
    # MoE layer -> copies of each expert (expert-parallel load balancing), read with expert_loads
    expert_replicas: dict[str, list[int]] | None = None


@dataclass
class RequestTimer:
    """Timestamps of one core request, from arrival to its end."""

    arrival: float
    num_prompt_tokens: int
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    num_generation_tokens: int = 0

    def on_step(self, step_start: float, now: float, new_tokens: int, stats: IterationStats) -> None:
        if self.first_scheduled is None:
            self.first_scheduled = step_start
        if new_tokens == 0:
            return
        if self.first_token is None:
            self.first_token = now
            stats.time_to_first_tokens.append(now - self.arrival)
        elif self.last_token is not None:
            stats.inter_token_latencies.append(now - self.last_token)
        self.last_token = now
        self.num_generation_tokens += new_tokens
        stats.num_generation_tokens += new_tokens

    def finish(self, reason: str, now: float) -> FinishedRequestStats:
        scheduled = self.first_scheduled if self.first_scheduled is not None else now
        first = self.first_token if self.first_token is not None else now
        last = self.last_token if self.last_token is not None else first
        return FinishedRequestStats(
            finish_reason=reason,
            e2e_latency=now - self.arrival,
            queue_time=scheduled - self.arrival,
            prefill_time=max(0.0, first - scheduled),
            decode_time=max(0.0, last - first),
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
        )


class StatLogger(Protocol):
    def record(self, scheduler: SchedulerSnapshot, iteration: IterationStats) -> None:
        """Called by the engine after every step (in the engine's thread)."""
        ...
