"""The scheduler with steps in flight (pipeline micro-batches), with a real KV cache manager: a step is
scheduled before the previous ones' outputs are applied, as the engine core's ``MicroBatches`` does.
The model's sampled tokens are supplied by the test."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tokenmill.kv_cache import KVCacheManager
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler.output import ModelRunnerOutput, SchedulerOutput
from tokenmill.scheduler.scheduler import Scheduler, SchedulerConfig

BLOCK = 4
TOKEN = 7


def _scheduler(num_blocks: int = 64, steps_in_flight: int = 2, **config) -> Scheduler:
    defaults = dict(max_num_batched_tokens=32, max_num_seqs=8, max_model_len=64)
    return Scheduler(SchedulerConfig(**{**defaults, **config}, steps_in_flight=steps_in_flight),
                     KVCacheManager(num_blocks, BLOCK, True))


def _request(rid: str, prompt_len: int, max_tokens: int = 4, first: int = 10) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(range(first, first + prompt_len)),
                   sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True), max_tokens=max_tokens)


def _sampling(scheduler: Scheduler, out: SchedulerOutput) -> ModelRunnerOutput:
    """What the model samples for ``out``, decided when it is scheduled: a token for every
    request whose scheduled tokens reach its end."""
    sampled = {rid: [TOKEN] for rid, n in out.num_scheduled_tokens.items()
               if scheduler.requests[rid].num_computed_tokens + n >= scheduler.requests[rid].num_tokens}
    return ModelRunnerOutput(sampled=sampled)


def test_steps_in_flight_take_disjoint_shares_and_a_request_waits_for_its_output():
    scheduler = _scheduler()
    for i in range(4):
        scheduler.add_request(_request(f"r{i}", 5, first=10 + 10 * i))
    first = scheduler.schedule()
    second = scheduler.schedule()
    assert set(first.num_scheduled_tokens) == {"r0", "r1"} and set(second.num_scheduled_tokens) == {"r2", "r3"}
    assert scheduler.schedule().is_empty  # every request is in flight
    scheduler.update_from_output(first, _sampling(scheduler, first))
    third = scheduler.schedule()
    assert third.num_scheduled_tokens == {"r0": 1, "r1": 1}  # their decodes, not r2's or r3's
    assert [c.new_token_ids for c in third.scheduled_cached_reqs] == [[TOKEN], [TOKEN]]


def test_one_request_and_two_stages_run_one_micro_batch():
    scheduler = _scheduler()
    scheduler.add_request(_request("only", 5))
    assert scheduler.schedule().num_scheduled_tokens == {"only": 5}
    assert scheduler.schedule().is_empty


def test_an_aborted_request_in_flight_frees_its_blocks_and_its_output_is_dropped():
    scheduler = _scheduler()
    scheduler.add_request(_request("a", 9))
    scheduler.add_request(_request("b", 9, first=40))
    first = scheduler.schedule()
    assert set(first.num_scheduled_tokens) == {"a"}
    sampled = _sampling(scheduler, first)
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv.num_free_blocks == 64  # at once: b is waiting, a's blocks are back
    with pytest.raises(ValueError, match="already in use"):  # its step is still in flight
        scheduler.add_request(_request("a", 3))
    second = scheduler.schedule()
    assert set(second.num_scheduled_tokens) == {"b"} and "a" in second.finished_req_ids
    assert scheduler.update_from_output(first, sampled) == []  # a's step came back: nothing to report
    scheduler.add_request(_request("a", 3))  # its id is free now


def test_a_request_in_flight_is_never_the_preemption_victim():
    """Three prompts of two blocks fill the six; r0 and r1 come back with a token each and need a
    third block while r2, the newest (the FCFS victim), is in flight: r1 is preempted instead."""
    scheduler = _scheduler(num_blocks=6, max_num_batched_tokens=64, max_num_seqs=4)
    for i in range(3):
        scheduler.add_request(_request(f"r{i}", 8, max_tokens=8, first=10 + 10 * i))
    first, second = scheduler.schedule(), scheduler.schedule()
    assert set(first.num_scheduled_tokens) == {"r0", "r1"} and set(second.num_scheduled_tokens) == {"r2"}
    scheduler.update_from_output(first, _sampling(scheduler, first))
    third = scheduler.schedule()
    assert third.num_scheduled_tokens == {"r0": 1} and third.preempted_req_ids == {"r1"}
    assert scheduler.requests["r2"].status == RequestStatus.RUNNING
    (r2,) = scheduler.update_from_output(second, _sampling(scheduler, second))
    assert r2.req_id == "r2" and r2.new_token_ids == [TOKEN]


class InFlightMachine(RuleBasedStateMachine):
    """Schedules up to ``DEPTH`` steps ahead of their outputs, with aborts and a KV cache small
    enough to preempt, and checks that no request is in two steps in flight, none in flight is
    preempted, the blocks held are the blocks not free, and every request ends with all its tokens."""

    DEPTH = 3

    def __init__(self) -> None:
        super().__init__()
        self.scheduler = _scheduler(num_blocks=12, steps_in_flight=self.DEPTH, max_num_batched_tokens=12)
        self.in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput, dict[str, int]]] = deque()
        self.requests: dict[str, Request] = {}
        self.aborted: set[str] = set()

    @rule(prompt_len=st.integers(1, 20), max_tokens=st.integers(1, 6), shared=st.booleans())
    def add(self, prompt_len: int, max_tokens: int, shared: bool) -> None:
        rid = f"r{len(self.requests)}"
        request = _request(rid, prompt_len, max_tokens, first=10 if shared else 100 + 30 * len(self.requests))
        self.requests[rid] = request
        self.scheduler.add_request(request)

    @precondition(lambda self: len(self.in_flight) < self.DEPTH)
    @rule()
    def schedule(self) -> None:
        out = self.scheduler.schedule()
        flying = {rid for step, _, _ in self.in_flight for rid in step.num_scheduled_tokens}
        assert not flying & set(out.num_scheduled_tokens), "a request in two steps in flight"
        assert not flying & out.preempted_req_ids, "a request in flight was preempted"
        if not out.is_empty:
            computed = {rid: self.requests[rid].num_computed_tokens for rid in out.num_scheduled_tokens}
            self.in_flight.append((out, _sampling(self.scheduler, out), computed))

    @precondition(lambda self: self.in_flight)
    @rule()
    def complete_oldest(self) -> None:
        out, sampled, computed = self.in_flight.popleft()
        for rid, before in computed.items():
            request = self.requests[rid]
            if not request.is_finished:
                assert request.status == RequestStatus.RUNNING and request.num_computed_tokens == before
        self.scheduler.update_from_output(out, sampled)

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        live = sorted(self.scheduler.requests)
        if live:
            rid = data.draw(st.sampled_from(live))
            self.scheduler.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
            self.aborted.add(rid)

    @invariant()
    def held_blocks_are_the_blocks_not_free(self) -> None:
        kv = self.scheduler.kv
        held = {block for rid in self.scheduler.requests for block in kv.get_block_ids(rid)}
        assert kv.num_free_blocks == kv.num_blocks - len(held)

    def teardown(self) -> None:
        for _ in range(500):
            if not (self.in_flight or self.scheduler.has_unfinished_requests):
                break
            if self.in_flight and (len(self.in_flight) == self.DEPTH or len(self.in_flight) % 2):
                self.complete_oldest()
            else:
                self.schedule()
                if not self.in_flight:
                    continue
                self.complete_oldest()
        assert not self.in_flight and not self.scheduler.has_unfinished_requests
        assert self.scheduler.kv.num_free_blocks == self.scheduler.kv.num_blocks
        for rid, request in self.requests.items():
            if rid not in self.aborted:
                assert request.status == RequestStatus.FINISHED_LENGTH
                assert request.output_token_ids == [TOKEN] * request.max_tokens


InFlightMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                             suppress_health_check=[HealthCheck.too_slow])
test_in_flight_machine = InFlightMachine.TestCase
