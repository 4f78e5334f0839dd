"""The scheduler's side of the KV connector contract, with a real KV cache manager and a
connector whose answers the test sets (what a transport would report, step by step)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from tokenmill.errors import InvalidRequestError
from tokenmill.kv_cache import KVCacheManager
from tokenmill.kv_transfer import KVConnectorOutput, KVTransferParams, ScheduledKVRequest
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler.output import ModelRunnerOutput, SchedulerOutput
from tokenmill.scheduler.scheduler import Scheduler, SchedulerConfig

BLOCK = 4


class ScriptedConnector:
    """Offers ``offers[req_id]`` tokens; records what the scheduler tells it."""

    def __init__(self, offers: dict[str, int], keep: bool = False, answer: dict[str, Any] | None = None) -> None:
        self.offers = offers
        self.keep = keep
        self.answer = answer  # kv_transfer_params for a finished request's output, as (keep, answer)
        self.asked: list[str] = []
        self.allocated: dict[str, tuple[list[int], int]] = {}
        self.finished: list[str] = []
        self.steps: list[tuple[list[str], set[str]]] = []

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        self.asked.append(request.request_id)
        return self.offers.get(request.request_id, 0)

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        self.allocated[request.request_id] = (list(block_ids), num_external_tokens)

    def build_connector_meta(self, scheduled: Sequence[ScheduledKVRequest], finished_req_ids: set[str],
                             preempted_req_ids: set[str]) -> Any:
        self.steps.append(([s.request.request_id for s in scheduled], set(finished_req_ids)))
        return {"step": len(self.steps)}

    def request_finished(self, request: Request, block_ids: list[int]) -> bool | tuple[bool, dict[str, Any] | None]:
        self.finished.append(request.request_id)
        return self.keep if self.answer is None else (self.keep, self.answer)


def _scheduler(connector: ScriptedConnector, num_blocks: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64),
                     KVCacheManager(num_blocks, BLOCK, True), kv_connector=connector)


def _request(rid: str, prompt_len: int, first: int = 10) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(range(first, first + prompt_len)),
                   sampling_params=SamplingParams(max_tokens=2, ignore_eos=True), max_tokens=2)


def _step(scheduler: Scheduler, kv: KVConnectorOutput | None = None) -> SchedulerOutput:
    out = scheduler.schedule()
    sampled = {rid: [7] for rid, n in out.num_scheduled_tokens.items()
               if scheduler.requests[rid].num_computed_tokens + n >= scheduler.requests[rid].num_tokens}
    scheduler.update_from_output(out, ModelRunnerOutput(sampled=sampled, kv_connector_output=kv))
    return out


def test_a_request_waiting_for_remote_kv_blocks_nobody_and_runs_with_its_kv_loaded():
    connector = ScriptedConnector({"remote": 16})
    scheduler = _scheduler(connector)
    scheduler.add_request(_request("remote", 18))
    scheduler.add_request(_request("local", 6, first=100))
    out = _step(scheduler)
    assert out.num_scheduled_tokens == {"local": 6}  # the one behind it runs
    assert scheduler.requests["remote"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert out.kv_connector_metadata == {"step": 1}  # carried to the workers
    block_ids, num_external = connector.allocated["remote"]
    assert num_external == 16 and len(block_ids) == 4  # blocks for the loaded tokens only
    assert scheduler.make_stats().num_waiting_for_remote_kvs == 1

    _step(scheduler, KVConnectorOutput(finished_recving={"remote"}))  # the worker reports it loaded
    out = _step(scheduler)
    assert out.num_scheduled_tokens["remote"] == 2  # only the tail after the loaded blocks
    assert scheduler.make_stats().prefix_cache_external_hits == 16
    assert scheduler.kv.get_block_ids("remote")[:4] == block_ids
    assert connector.asked == ["remote", "local"]  # asked once each

    twin = _request("twin", 18)  # the loaded blocks are in the prefix cache now
    assert scheduler.kv.get_computed_blocks(twin)[1] == 16


def test_a_failed_load_gives_its_blocks_back_and_the_prompt_is_computed():
    connector = ScriptedConnector({"remote": 8})
    scheduler = _scheduler(connector, num_blocks=8)
    scheduler.add_request(_request("remote", 10))
    _step(scheduler)
    assert scheduler.kv.num_free_blocks == 8 - 2
    _step(scheduler, KVConnectorOutput(failed_recving={"remote"}))
    assert scheduler.requests["remote"].status == RequestStatus.WAITING
    out = _step(scheduler)
    assert out.num_scheduled_tokens == {"remote": 10}  # the whole prompt, computed here
    assert connector.asked == ["remote"]  # not offered again
    assert scheduler.make_stats().prefix_cache_external_hits == 0


def test_aborting_a_request_waiting_for_remote_kv_frees_its_blocks_and_tells_the_connector():
    connector = ScriptedConnector({"remote": 8})
    scheduler = _scheduler(connector, num_blocks=8)
    scheduler.add_request(_request("remote", 10))
    _step(scheduler)
    scheduler.finish_requests(["remote"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv.num_free_blocks == 8
    assert connector.finished == ["remote"]
    _step(scheduler, KVConnectorOutput(finished_recving={"remote"}))  # a late report is ignored
    assert connector.steps[-1][1] == {"remote"}  # the next step tells the worker side
    assert not scheduler.has_unfinished_requests and scheduler.kv.num_free_blocks == 8


def test_kept_blocks_stay_taken_until_the_worker_reports_them_sent():
    connector = ScriptedConnector({}, keep=True)
    scheduler = _scheduler(connector, num_blocks=8)
    scheduler.add_request(_request("produced", 9))
    _step(scheduler)
    _step(scheduler)  # its second token: finished
    assert connector.finished == ["produced"] and not scheduler.has_unfinished_requests
    assert scheduler.kv.num_free_blocks == 8 - 3
    _step(scheduler, KVConnectorOutput(finished_sending={"produced"}))
    assert scheduler.kv.num_free_blocks == 8


def test_an_offer_of_a_partial_block_or_of_the_last_token_is_ignored():
    connector = ScriptedConnector({"partial": 6, "whole": 12})
    scheduler = _scheduler(connector)
    scheduler.add_request(_request("partial", 10))
    scheduler.add_request(_request("whole", 12, first=200))  # 12 tokens: at most 8 may be loaded
    out = _step(scheduler)
    assert out.num_scheduled_tokens == {"partial": 10, "whole": 12}
    assert connector.allocated == {}


def test_each_step_hands_the_connector_its_scheduled_requests():
    connector = ScriptedConnector({})
    scheduler = _scheduler(connector)
    scheduler.add_request(_request("a", 5))
    _step(scheduler)
    assert connector.steps == [(["a"], set())]


def test_the_connectors_kv_transfer_params_ride_on_the_finishing_output_only():
    answer = {"do_remote_prefill": True, "remote_host": "10.0.0.1", "remote_port": 5600}
    scheduler = _scheduler(ScriptedConnector({}, keep=True, answer=answer))
    scheduler.add_request(_request("r", 6))
    outputs = []
    for _ in range(3):
        out = scheduler.schedule()
        sampled = {rid: [7] for rid in out.num_scheduled_tokens}
        outputs += scheduler.update_from_output(out, ModelRunnerOutput(sampled=sampled))
    assert [o.kv_transfer_params for o in outputs] == [None, answer]  # two tokens: on the last one
    assert scheduler.has_kept_blocks  # (keep, params): the blocks are kept as with a bare True


def test_kv_transfer_params_of_the_wrong_shape_are_refused_when_the_request_is_made():
    good = SamplingParams(extra_args={"kv_transfer_params": {"do_remote_decode": True, "a_connectors_own": [1]}})
    assert KVTransferParams.parse(good.extra_args["kv_transfer_params"]).do_remote_decode is True
    # JSON Schema's integer includes 5600.0 (what a JavaScript client may send); it is read as 5600
    as_json_numbers = KVTransferParams.parse({"remote_port": 5600.0, "remote_block_ids": [3.0, 4]})
    assert (as_json_numbers.remote_port, as_json_numbers.remote_block_ids) == (5600, [3, 4])
    schema = KVTransferParams.model_json_schema()["properties"]  # the bounds reach the server's OpenAPI schema
    assert schema["remote_port"]["anyOf"][0] == {"type": "integer", "minimum": 1, "maximum": 65535}
    assert schema["remote_block_ids"]["anyOf"][0]["items"] == {"type": "integer", "minimum": 0}
    for bad in ({"do_remote_prefill": "yes"}, {"remote_port": 70000}, {"remote_port": "5600"},
                {"remote_port": 5600.5}, {"remote_port": True},
                {"remote_block_ids": [1, -2]}, {"remote_host": ""}, ["do_remote_decode"]):
        with pytest.raises(InvalidRequestError) as raised:
            SamplingParams(extra_args={"kv_transfer_params": bad})
        assert raised.value.param == "kv_transfer_params"
