"""Under tensor parallelism every rank reports its own slice's transfers: the scheduler hears of a
load once every rank finished it (failed if any failed), and of a send once every rank sent; a
connector that does not say it moves its rank's heads is refused with more than one rank."""

from __future__ import annotations

import pytest

from tokenmill.config import EngineConfig
from tokenmill.kv_transfer import KVConnectorOutput
from tokenmill.kv_transfer.aggregate import KVOutputAggregator
from tokenmill.kv_transfer.registry import check_connector
from tokenmill.plugins.specs import KVConnectorSpec


def test_a_transfer_is_reported_once_every_rank_reported_it_and_failed_if_any_failed():
    aggregator = KVOutputAggregator(2)
    step1 = aggregator.merge([KVConnectorOutput(finished_recving={"a", "b"}, finished_sending={"p"}),
                              KVConnectorOutput(failed_recving={"b"})])
    assert step1 == KVConnectorOutput(failed_recving={"b"})  # rank 1 failed b; a waits for rank 1
    step2 = aggregator.merge([KVConnectorOutput(), KVConnectorOutput(finished_recving={"a"}, finished_sending={"p"})])
    assert step2 == KVConnectorOutput(finished_recving={"a"}, finished_sending={"p"})
    assert aggregator.merge([KVConnectorOutput(), KVConnectorOutput()]) == KVConnectorOutput()  # each said once
    assert aggregator.merge([None, None]) is None  # no connector


def test_a_connector_that_does_not_declare_tensor_parallel_is_refused_with_more_than_one_rank():
    config = EngineConfig(model="unused", tensor_parallel_size=2, kv_transfer_config={"kv_connector": "c"})
    with pytest.raises(ValueError, match="'c' runs with one worker rank only"):
        check_connector(KVConnectorSpec("c", "m:Scheduler", "m:Worker"), config)
    check_connector(KVConnectorSpec("c", "m:Scheduler", "m:Worker", tensor_parallel=True), config)
    with pytest.raises(ValueError, match="pipeline parallelism"):
        EngineConfig(model="unused", pipeline_parallel_size=2, kv_transfer_config={"kv_connector": "c"})
