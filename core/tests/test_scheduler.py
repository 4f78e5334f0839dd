"""The scheduler with a real KV cache manager; the model's sampled tokens are supplied by the test."""

from __future__ import annotations

from tokenmill.kv_cache import KVCacheManager
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler.output import ModelRunnerOutput, SchedulerOutput
from tokenmill.scheduler.scheduler import Scheduler, SchedulerConfig

BLOCK = 4


def _scheduler(num_blocks=64, **config) -> Scheduler:
    defaults = dict(max_num_batched_tokens=32, max_num_seqs=8, max_model_len=64)
    return Scheduler(SchedulerConfig(**{**defaults, **config}), KVCacheManager(num_blocks, BLOCK, True))


def _request(rid: str, prompt_len: int, max_tokens: int = 4, priority: int = 0, first: int = 10) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(range(first, first + prompt_len)),
                   sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   max_tokens=max_tokens, priority=priority)


def _run_step(scheduler: Scheduler, token: int = 7) -> SchedulerOutput:
    """Schedule, pretend the model ran, and sample ``token`` wherever a request reached its end."""
    out = scheduler.schedule()
    sampled = {}
    for rid, n in out.num_scheduled_tokens.items():
        request = scheduler.requests[rid]
        if request.num_computed_tokens + n >= request.num_tokens:
            sampled[rid] = [token]
    scheduler.update_from_output(out, ModelRunnerOutput(sampled=sampled))
    return out


def test_token_budget_and_chunked_prefill():
    scheduler = _scheduler(max_num_batched_tokens=16)
    scheduler.add_request(_request("a", 40))
    steps = [_run_step(scheduler).num_scheduled_tokens["a"] for _ in range(3)]
    assert steps == [16, 16, 8]
    assert scheduler.requests["a"].num_output_tokens == 1


def test_running_requests_first_then_waiting_mixed_batch():
    scheduler = _scheduler(max_num_batched_tokens=20)
    scheduler.add_request(_request("a", 10))
    _run_step(scheduler)  # a's prefill
    scheduler.add_request(_request("b", 30, first=100))
    out = _run_step(scheduler)
    assert out.num_scheduled_tokens == {"a": 1, "b": 19}  # a decode and b's first chunk in one step
    assert [r.req_id for r in out.scheduled_new_reqs] == ["b"]
    assert [r.req_id for r in out.scheduled_cached_reqs] == ["a"]


def test_max_num_seqs_caps_the_batch():
    scheduler = _scheduler(max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(4):
        scheduler.add_request(_request(f"r{i}", 5, first=10 + 10 * i))
    out = _run_step(scheduler)
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}


def test_without_chunked_prefill_a_prompt_waits_for_a_full_budget():
    scheduler = _scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False)
    scheduler.add_request(_request("a", 10))
    scheduler.add_request(_request("b", 10, first=50))
    out = _run_step(scheduler)
    assert out.num_scheduled_tokens == {"a": 10}


def test_preemption_when_blocks_run_out_and_recompute_later():
    scheduler = _scheduler(num_blocks=6, max_num_batched_tokens=64)  # 24 token slots
    scheduler.add_request(_request("old", 11, max_tokens=8))
    scheduler.add_request(_request("new", 11, max_tokens=8, first=60))
    new = scheduler.requests["new"]
    _run_step(scheduler)  # both prefilled: 3 + 3 blocks, all used
    _run_step(scheduler)  # the 12th token still fits
    assert scheduler.num_preemptions == 0
    _run_step(scheduler)  # each needs a 4th block for its 13th token: the newest is preempted
    assert scheduler.num_preemptions == 1 and new.status == RequestStatus.PREEMPTED
    assert new.num_computed_tokens == 0 and scheduler.requests["old"].status == RequestStatus.RUNNING
    for _ in range(40):
        if not scheduler.has_unfinished_requests:
            break
        _run_step(scheduler)
    assert not scheduler.has_unfinished_requests
    assert new.status == RequestStatus.FINISHED_LENGTH and new.num_output_tokens == 8
    assert scheduler.kv.num_free_blocks == 6


def test_priority_policy_admits_lowest_value_first_and_preempts_highest():
    scheduler = _scheduler(max_num_seqs=1, policy="priority")
    scheduler.add_request(_request("low", 5, priority=5))
    scheduler.add_request(_request("high", 5, priority=0, first=40))
    assert set(_run_step(scheduler).num_scheduled_tokens) == {"high"}


def test_finish_requests_frees_blocks_and_reports_ids():
    scheduler = _scheduler()
    scheduler.add_request(_request("a", 9))
    _run_step(scheduler)
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv.num_free_blocks == 64
    assert "a" in scheduler.schedule().finished_req_ids


def test_prefix_cache_hits_after_the_first_request_computed():
    scheduler = _scheduler()
    scheduler.add_request(_request("a", 17, max_tokens=1))
    _run_step(scheduler)
    scheduler.add_request(_request("b", 17, max_tokens=1))
    out = _run_step(scheduler)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 16  # (17 - 1) // 4 blocks
    assert out.num_scheduled_tokens == {"b": 1}


def test_prompt_only_request_finishes_after_its_chunked_prefill_without_a_token():
    """max_tokens 0 (scoring): the whole prompt is computed, in chunks, then the request ends as
    "length" with no output token (the runner samples none for it); a neighbour decodes on."""
    scheduler = _scheduler(max_num_batched_tokens=16)
    scheduler.add_request(_request("gen", 4, max_tokens=3, first=100))
    scheduler.add_request(_request("score", 20, max_tokens=0))
    steps = []
    for _ in range(2):
        out = scheduler.schedule()
        finals = scheduler.update_from_output(out, ModelRunnerOutput(sampled={"gen": [7]}))
        steps.append((out.num_scheduled_tokens, {o.req_id: (o.new_token_ids, o.finish_status) for o in finals}))
    assert steps[0] == ({"gen": 4, "score": 12}, {"gen": ([7], None), "score": ([], None)})
    assert steps[1] == ({"gen": 1, "score": 8}, {"gen": ([7], None), "score": ([], RequestStatus.FINISHED_LENGTH)})
    assert "score" not in scheduler.requests
    assert scheduler.kv.num_free_blocks == 64 - len(scheduler.kv.get_block_ids("gen"))
