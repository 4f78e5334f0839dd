"""The scheduler with draft tokens, a real KV cache manager, and the target's verdict supplied
by the test: drafts count in the token budget and get KV slots, rejected ones are taken back
off ``num_computed_tokens``, never reach the prefix cache and give their blocks back at once,
finished requests free all."""

from __future__ import annotations

from tokenmill.kv_cache import KVCacheManager
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler.output import ModelRunnerOutput, SchedulerOutput
from tokenmill.scheduler.scheduler import Scheduler, SchedulerConfig

BLOCK = 4


def _scheduler(k: int = 3, **config) -> Scheduler:
    defaults = dict(max_num_batched_tokens=32, max_num_seqs=8, max_model_len=64, num_speculative_tokens=k)
    return Scheduler(SchedulerConfig(**{**defaults, **config}), KVCacheManager(64, BLOCK, True))


def _request(rid: str, prompt_len: int, max_tokens: int = 20) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(range(10, 10 + prompt_len)),
                   sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True), max_tokens=max_tokens)


def _prefill(scheduler: Scheduler, rid: str, proposed: list[int]) -> None:
    out = scheduler.schedule()
    scheduler.update_from_output(out, ModelRunnerOutput(sampled={rid: [1]}, spec_token_ids={rid: proposed}))


def test_drafts_count_in_the_budget_and_get_slots():
    scheduler = _scheduler()
    scheduler.add_request(_request("a", 8))
    _prefill(scheduler, "a", [2, 3, 4, 5])  # one more than k: cut to 3
    assert scheduler.requests["a"].spec_token_ids == [2, 3, 4]
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 4}  # the last sampled token and three drafts
    assert out.scheduled_spec_decode_tokens == {"a": [2, 3, 4]}
    assert len(scheduler.kv.get_block_ids("a")) == 3  # 12 tokens' slots: 8 + 1 + 3


def test_rejected_drafts_are_taken_back_and_never_cached():
    scheduler = _scheduler()
    scheduler.add_request(_request("a", 8))
    _prefill(scheduler, "a", [2, 3, 4])
    out = scheduler.schedule()
    # the target accepts 2 and rejects 3 (it samples 9 instead): 8 + 1 + 1 tokens are computed
    scheduler.update_from_output(out, ModelRunnerOutput(sampled={"a": [2, 9]}))
    request = scheduler.requests["a"]
    assert request.output_token_ids == [1, 2, 9]
    assert request.num_computed_tokens == 10
    assert request.num_tokens - request.num_computed_tokens == 1  # the resampled token is the next input
    pool = scheduler.kv.block_pool
    assert len(pool.cached_blocks) == 10 // BLOCK  # blocks of verified tokens only
    stats = scheduler.make_stats()
    assert (stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens) == (3, 1)
    assert stats.spec_decode_accepted_per_position == (1, 0, 0)


def test_a_tight_budget_cuts_the_drafts_and_a_finished_request_frees_everything():
    scheduler = _scheduler(max_num_batched_tokens=10)
    scheduler.add_request(_request("a", 6))
    scheduler.add_request(_request("b", 4))
    out = scheduler.schedule()
    scheduler.update_from_output(out, ModelRunnerOutput(sampled={"a": [1], "b": [1]},
                                                        spec_token_ids={"a": [2, 3, 4], "b": [5, 6, 7]}))
    scheduler.config.max_num_batched_tokens = 6
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 4, "b": 2}
    assert out.scheduled_spec_decode_tokens == {"a": [2, 3, 4], "b": [5]}
    scheduler.finish_requests(["a", "b"], scheduler.requests["a"].status.FINISHED_ABORTED)
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks


def test_no_drafts_past_max_tokens_or_for_a_last_token():
    scheduler = _scheduler()
    scheduler.add_request(_request("a", 8, max_tokens=3))
    _prefill(scheduler, "a", [2, 3, 4])
    assert scheduler.requests["a"].spec_token_ids == [2]  # one output so far: room for one draft and one more
    out = scheduler.schedule()
    scheduler.update_from_output(out, ModelRunnerOutput(sampled={"a": [2, 5]}))
    assert scheduler.requests.get("a") is None  # three tokens: finished, released


def test_blocks_of_rejected_drafts_go_back_to_the_pool_and_the_workers_learn_it():
    scheduler = _scheduler()
    scheduler.add_request(_request("a", 6))
    _prefill(scheduler, "a", [2, 3, 4])
    out = scheduler.schedule()  # 6 + 1 + 3 = 10 tokens' slots: 3 blocks
    assert len(scheduler.kv.get_block_ids("a")) == 3
    free = scheduler.kv.num_free_blocks
    scheduler.update_from_output(out, ModelRunnerOutput(sampled={"a": [9]}, spec_token_ids={"a": [5, 6, 7]}))
    request = scheduler.requests["a"]
    assert request.num_tokens == 8  # every draft rejected: the prompt and two sampled tokens
    kept = scheduler.kv.get_block_ids("a")
    assert len(kept) == 3 - 1 and scheduler.kv.num_free_blocks == free + 1  # the third block held drafts only
    out = scheduler.schedule()
    (diff,) = out.scheduled_cached_reqs
    assert diff.num_kept_blocks == 2  # the workers cut their block table to these before appending
    assert scheduler.kv.get_block_ids("a") == kept + diff.new_block_ids


def test_a_request_whose_drafts_keep_missing_decodes_a_while_without_them():
    scheduler = _scheduler(spec_min_acceptance_rate=0.5, spec_acceptance_window=4, spec_backoff_tokens=3)
    scheduler.add_request(_request("miss", 8, max_tokens=40))
    scheduler.add_request(_request("hit", 8, max_tokens=40))
    out = scheduler.schedule()
    proposals = {"miss": [2, 3, 4], "hit": [5, 6, 7]}
    scheduler.update_from_output(out, ModelRunnerOutput(sampled={"miss": [1], "hit": [1]}, spec_token_ids=proposals))
    carried = []
    for _ in range(6):
        out = scheduler.schedule()
        carried.append({rid: len(d) for rid, d in out.scheduled_spec_decode_tokens.items()})
        sampled = {"miss": [9]}  # every draft rejected
        sampled["hit"] = [*out.scheduled_spec_decode_tokens.get("hit", []), 8]  # every draft accepted
        if "miss" not in out.scheduled_spec_decode_tokens:
            sampled["miss"] = [9]
        scheduler.update_from_output(out, ModelRunnerOutput(sampled=sampled, spec_token_ids=proposals))
    # one verification of 3 rejected drafts decides "miss" (even a 4th draft accepted would leave it
    # below 0.5 of 4): it pauses for 3 output tokens (3 steps of one token), then carries drafts
    # again, is rejected again and pauses (longer); "hit" never pauses
    assert [c.get("miss", 0) for c in carried] == [3, 0, 0, 0, 3, 0]
    assert all(c["hit"] == 3 for c in carried)
    assert scheduler.draft_backoff.num_pauses == 2

def _step(scheduler: Scheduler, hits: dict[str, bool], proposals: dict[str, list[int]]) -> SchedulerOutput:
    """One step: each request's drafts all accepted (True) or all rejected (False); the workers
    propose only for the requests the scheduler did not exclude."""
    out = scheduler.schedule()
    sampled = {rid: (out.scheduled_spec_decode_tokens.get(rid, []) if hit else []) + [8] for rid, hit in hits.items()}
    asked = {rid: p for rid, p in proposals.items() if rid not in out.no_draft_req_ids}
    scheduler.update_from_output(out, ModelRunnerOutput(sampled=sampled, spec_token_ids=asked))
    return out


def test_a_paused_request_is_not_proposed_for_and_its_pauses_grow_until_a_probe_passes():
    scheduler = _scheduler(spec_min_acceptance_rate=0.5, spec_acceptance_window=3, spec_backoff_tokens=2)
    scheduler.add_request(_request("a", 8, max_tokens=60))
    _prefill(scheduler, "a", [2, 3, 4])
    asked = []  # per step: whether the workers propose for "a" after it
    for step in range(12):
        out = _step(scheduler, {"a": step >= 8}, {"a": [2, 3, 4]})  # rejected until step 8, accepted from then on
        asked.append("a" not in out.no_draft_req_ids)
    # step 0 rejects 3 drafts: paused for 2 tokens (no proposals after step 1; those after step 2
    # come when the pause is over), probed at step 3 and rejected again: paused for twice as long
    # (steps 4-6), probed at step 8 and accepted: the request keeps its drafts
    assert asked == [True, False, True, True, False, False, False, True, True, True, True, True]
    stats = scheduler.make_stats()
    assert stats.spec_decode_num_paused_requests == 2
    # the proposals of the two judging steps (0 and 3) are dropped, the others were never made
    assert stats.spec_decode_num_paused_steps == asked.count(False) + 2
    assert stats.spec_decode_num_accepted_tokens == 4 * 3


def test_no_drafts_while_the_batch_is_larger_than_disable_by_batch_size():
    scheduler = _scheduler(spec_disable_by_batch_size=2)
    for rid, max_tokens in (("a", 3), ("b", 30), ("c", 30)):
        scheduler.add_request(_request(rid, 4, max_tokens=max_tokens))
    proposals = {rid: [2, 3] for rid in "abc"}
    out = _step(scheduler, dict.fromkeys("abc", False), proposals)  # the prefills: three running
    assert out.no_draft_req_ids == {"a", "b", "c"}
    carried = []
    for _ in range(4):
        out = _step(scheduler, dict.fromkeys(scheduler.requests, True), proposals)
        carried.append({rid: len(d) for rid, d in out.scheduled_spec_decode_tokens.items()})
    # "a" finishes with the second decode's token (its third): two run from the third step on, the
    # workers propose after it, and the fourth carries drafts
    assert carried == [{}, {}, {}, {"b": 2, "c": 2}]
    assert out.no_draft_req_ids == set()
    assert scheduler.make_stats().spec_decode_num_steps_drafting_off == 3  # the prefill and two decodes
