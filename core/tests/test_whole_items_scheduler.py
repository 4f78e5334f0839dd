"""A scheduler whose model computes each multimodal item whole (``whole_mm_items``, Gemma 3): a
prefill chunk never ends inside an item, with a real scheduler and KV cache manager; the sampled
tokens are supplied by the test. Also the encoder-budget counters the metrics read."""

from __future__ import annotations

from test_encoder_budget_scheduler import _request, _run_step

from tokenmill.kv_cache import KVCacheManager
from tokenmill.multimodal.inputs import MultiModalItem
from tokenmill.scheduler.scheduler import Scheduler, SchedulerConfig
from tokenmill.scheduler.whole_items import whole_items_chunk


def _scheduler(**config) -> Scheduler:
    defaults = dict(max_num_batched_tokens=10, max_num_seqs=8, max_model_len=128, encoder_cache_size=64)
    return Scheduler(SchedulerConfig(**{**defaults, **config}), KVCacheManager(64, 4, False))


def test_a_chunk_stops_before_an_item_it_would_cut():
    scheduler = _scheduler(whole_mm_items=True)
    scheduler.add_request(_request("r", 24, [(3, 8, "a"), (13, 8, "b")]))
    steps = [_run_step(scheduler).num_scheduled_tokens for _ in range(4)]
    assert steps == [{"r": 3}, {"r": 10}, {"r": 10}, {"r": 1}]  # 0..3, a + 2, b + 2, the last token


def test_without_whole_items_a_chunk_cuts_through_an_item():
    scheduler = _scheduler()
    scheduler.add_request(_request("r", 24, [(3, 8, "a"), (13, 8, "b")]))
    assert _run_step(scheduler).num_scheduled_tokens == {"r": 10}


def test_a_chunk_that_starts_inside_an_item_reaches_its_end_or_waits():
    items = [MultiModalItem("image", 4, 8, "a")]
    assert whole_items_chunk(items, 8, 4) == 4  # reaches the end at 12
    assert whole_items_chunk(items, 8, 3) == 0  # would end inside: waits for a bigger budget
    assert whole_items_chunk(items, 0, 6) == 4  # stops before it
    assert whole_items_chunk(items, 12, 6) == 6  # past it


def test_the_encoder_budget_counts_what_it_schedules_and_defers():
    scheduler = _scheduler(max_num_batched_tokens=64, max_num_encoder_input_tokens=8)
    scheduler.add_request(_request("r", 40, [(4, 6, "a"), (14, 6, "b")]))
    _run_step(scheduler)
    _run_step(scheduler)
    stats = scheduler.make_stats()
    assert (stats.encoder_input_tokens, stats.encoder_budget_deferrals) == (12, 1)
