"""The scheduler's per-step encoder budget and its mirror of the workers' encoder cache, with
a real scheduler and KV cache manager; the model's sampled tokens are supplied by the test."""

from __future__ import annotations

from tokenmill.kv_cache import KVCacheManager
from tokenmill.multimodal.inputs import MultiModalItem
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler.output import ModelRunnerOutput, SchedulerOutput
from tokenmill.scheduler.scheduler import Scheduler, SchedulerConfig


def _scheduler(**config) -> Scheduler:
    defaults = dict(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=128, encoder_cache_size=64)
    return Scheduler(SchedulerConfig(**{**defaults, **config}), KVCacheManager(64, 4, False))


def _request(rid: str, prompt_len: int, items: list[tuple[int, int, str]]) -> Request:
    """A prompt with an image of ``length`` placeholder tokens at each ``offset``, named by ``hash``."""
    return Request(request_id=rid, prompt_token_ids=list(range(10, 10 + prompt_len)),
                   sampling_params=SamplingParams(max_tokens=2, ignore_eos=True), max_tokens=2,
                   mm_inputs=[MultiModalItem("image", offset, length, key) for offset, length, key in items])


def _run_step(scheduler: Scheduler) -> SchedulerOutput:
    out = scheduler.schedule()
    sampled = {rid: [7] for rid, n in out.num_scheduled_tokens.items()
               if scheduler.requests[rid].num_computed_tokens + n >= scheduler.requests[rid].num_tokens}
    scheduler.update_from_output(out, ModelRunnerOutput(sampled=sampled))
    return out


def test_a_chunk_stops_before_the_image_that_does_not_fit_the_budget():
    scheduler = _scheduler(max_num_encoder_input_tokens=8)
    scheduler.add_request(_request("r", 40, [(4, 6, "a"), (14, 6, "b")]))
    first = _run_step(scheduler)
    assert first.num_scheduled_tokens == {"r": 14}  # up to b's first placeholder
    assert first.scheduled_encoder_inputs == {"r": [0]}
    second = _run_step(scheduler)
    assert second.num_scheduled_tokens == {"r": 26}  # the rest of the prompt, b encoded now
    assert second.scheduled_encoder_inputs == {"r": [1]}
    assert scheduler.encoder.num_over_budget_steps == 0


def test_a_decode_is_not_held_back_by_another_request_s_images():
    scheduler = _scheduler(max_num_encoder_input_tokens=6)
    scheduler.add_request(_request("text", 4, []))
    _run_step(scheduler)  # its prefill
    scheduler.add_request(_request("r", 30, [(0, 6, "a"), (6, 6, "b"), (12, 6, "c")]))
    steps = [_run_step(scheduler) for _ in range(3)]
    assert [s.num_scheduled_tokens for s in steps] == [{"text": 1, "r": 6}, {"r": 6}, {"r": 18}]
    assert [s.scheduled_encoder_inputs for s in steps] == [{"r": [0]}, {"r": [1]}, {"r": [2]}]


def test_an_item_larger_than_the_budget_is_encoded_alone():
    scheduler = _scheduler(max_num_encoder_input_tokens=4)
    scheduler.add_request(_request("big", 16, [(2, 10, "big")]))
    scheduler.add_request(_request("small", 8, [(0, 2, "small")]))
    first = _run_step(scheduler)
    assert first.scheduled_encoder_inputs == {"big": [0]}
    assert first.num_scheduled_tokens == {"big": 16}  # "small" waits: the step's encoder budget is spent
    second = _run_step(scheduler)
    assert second.scheduled_encoder_inputs == {"small": [0]}
    assert second.num_scheduled_tokens == {"big": 1, "small": 8}
    assert scheduler.encoder.num_over_budget_steps == 1  # the oversized item's step, and no other


def test_an_item_in_the_encoder_cache_costs_nothing():
    scheduler = _scheduler(max_num_encoder_input_tokens=6)
    scheduler.add_request(_request("first", 10, [(2, 6, "same")]))
    assert _run_step(scheduler).scheduled_encoder_inputs == {"first": [0]}
    scheduler.add_request(_request("second", 20, [(0, 6, "same"), (6, 6, "other")]))
    out = _run_step(scheduler)
    assert out.scheduled_encoder_inputs == {"second": [1]}  # "same" is cached: all 6 tokens left for "other"
    assert out.num_scheduled_tokens == {"first": 1, "second": 20}


def test_the_encoder_cache_must_hold_the_items_running_requests_still_need():
    scheduler = _scheduler(max_num_encoder_input_tokens=64, encoder_cache_size=10, max_num_batched_tokens=16)
    scheduler.add_request(_request("a", 12, [(0, 6, "a")]))
    scheduler.add_request(_request("b", 12, [(0, 6, "b")]))
    first = _run_step(scheduler)
    # 4 tokens of the step's budget are left for "b", but its image does not fit the cache beside
    # "a"'s, which is pinned until "a" has computed past it
    assert first.num_scheduled_tokens == {"a": 12}
    assert first.scheduled_encoder_inputs == {"a": [0]}
    second = _run_step(scheduler)
    assert second.scheduled_encoder_inputs == {"b": [0]}
    assert second.free_encoder_hashes == ["a"]  # evicted to make room: the workers drop it first
    assert second.num_scheduled_tokens == {"a": 1, "b": 12}


def test_a_cache_too_small_for_an_item_encodes_it_for_each_chunk():
    scheduler = _scheduler(max_num_encoder_input_tokens=64, encoder_cache_size=4, max_num_batched_tokens=5)
    scheduler.add_request(_request("r", 12, [(2, 8, "wide")]))
    steps = [_run_step(scheduler) for _ in range(3)]
    assert [s.num_scheduled_tokens for s in steps] == [{"r": 5}, {"r": 5}, {"r": 2}]
    assert [s.scheduled_encoder_inputs for s in steps] == [{"r": [0]}, {"r": [0]}, {}]


def test_items_are_budgeted_in_prompt_order_whatever_their_list_order():
    scheduler = _scheduler(max_num_encoder_input_tokens=8)
    scheduler.add_request(_request("r", 40, [(14, 6, "later"), (4, 6, "earlier")]))  # e.g. videos listed after images
    first = _run_step(scheduler)
    assert first.num_scheduled_tokens == {"r": 14}
    assert first.scheduled_encoder_inputs == {"r": [1]}
