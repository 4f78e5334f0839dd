"""Pipeline micro-batches: the engine core's steps kept in flight, so that the stages overlap.

With ``pipeline_parallel_size`` stages and one step at a time, every stage but one would be idle.
:class:`MicroBatches` keeps up to one step per stage in flight: each :meth:`MicroBatches.step`
schedules and sends steps until that many are in flight or nothing more can be scheduled, then
waits for the oldest and applies its output. Every rank runs its calls in the order they were
sent (a step's forward, then its sampling), and a stage hands its hidden states on without
waiting for the next stage to take them, so stage 0 computes step 2 while stage 1 computes
step 1. The scheduler puts a request in at most one step in flight and gives each step a share
of the requests: with fewer requests than stages the pipeline runs fewer micro-batches.

An empty schedule while steps are in flight is not sent; the request ids it carries (finished or
preempted since the last step, which the workers must drop) go with the next step sent, which
every rank runs after the steps in flight. With nothing in flight an empty schedule goes back to
the engine core's plain step, which sends it and waits for grammars to compile. (An empty
schedule has no LoRA loads or KV connector metadata to carry: neither runs with pipeline stages.)
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

from tokenmill.executor import Executor
from tokenmill.scheduler.output import EngineCoreOutputs, ModelRunnerOutput, SchedulerOutput
from tokenmill.scheduler.scheduler import Scheduler


@dataclass
class _InFlight:
    """A step sent to the workers, its output not applied yet."""

    scheduler_output: SchedulerOutput
    forward: Future[list[None]]
    sampled: Future[ModelRunnerOutput]


@dataclass
class MicroBatchStats:
    """Cumulative since start-up: steps sent, and how many of them were sent with no other step
    in flight (where the pipeline fills from empty). ``sent / fills`` is the mean number of
    micro-batches per fill, the ``m`` of the ideal bubble ``(pp - 1) / (m + pp - 1)``."""

    sent: int = 0
    fills: int = 0


@dataclass
class MicroBatches:
    """Up to ``depth`` steps in flight between ``scheduler`` and ``executor``."""

    depth: int
    scheduler: Scheduler
    executor: Executor
    stats: MicroBatchStats = field(default_factory=MicroBatchStats)
    _queue: deque[_InFlight] = field(default_factory=deque)
    _carried_finished: set[str] = field(default_factory=set)
    _carried_preempted: set[str] = field(default_factory=set)

    def in_flight_request_ids(self) -> set[str]:
        """The requests of the steps in flight (sent, their outputs not applied yet)."""
        return {req_id for step in self._queue for req_id in step.scheduler_output.num_scheduled_tokens}

    def step(self) -> EngineCoreOutputs | SchedulerOutput:
        """The oldest step's outputs, once as many steps as may be are in flight; or, with none in
        flight and nothing to schedule, the empty schedule, for the plain step to run."""
        while len(self._queue) < self.depth:
            scheduler_output = self._schedule()
            if not scheduler_output.is_empty:
                self._send(scheduler_output)
                continue
            if not self._queue:
                return scheduler_output
            self._carried_finished |= scheduler_output.finished_req_ids
            self._carried_preempted |= scheduler_output.preempted_req_ids
            break
        return self._finish_oldest()

    def _schedule(self) -> SchedulerOutput:
        """The scheduler's next step, with the ids an earlier empty schedule carried."""
        scheduler_output = self.scheduler.schedule()
        if self._carried_finished or self._carried_preempted:
            scheduler_output.finished_req_ids = self._carried_finished | scheduler_output.finished_req_ids
            scheduler_output.preempted_req_ids = self._carried_preempted | scheduler_output.preempted_req_ids
            self._carried_finished, self._carried_preempted = set(), set()
        return scheduler_output

    def _send(self, scheduler_output: SchedulerOutput) -> None:
        forward = self.executor.execute_model(scheduler_output, non_block=True)
        grammar = self.scheduler.grammar_bitmask(scheduler_output)  # built while the first stage runs
        sampled = self.executor.sample_tokens(grammar, non_block=True)
        self.stats.sent += 1
        self.stats.fills += not self._queue
        self._queue.append(_InFlight(scheduler_output, forward, sampled))

    def _finish_oldest(self) -> EngineCoreOutputs:
        oldest = self._queue.popleft()
        oldest.forward.result()  # a failed forward raises here, before its sampling's later error
        runner_output = oldest.sampled.result()
        outputs = self.scheduler.update_from_output(oldest.scheduler_output, runner_output)
        return EngineCoreOutputs(outputs, self.scheduler.make_stats(),
                                 oldest.scheduler_output.total_num_scheduled_tokens)
