"""Under tensor parallelism every rank reports its own slice's transfers: the scheduler hears of a
load once every rank finished it (failed if any failed), and of a send once every rank sent."""

from __future__ import annotations

from tokenmill.kv_transfer import KVConnectorOutput
from tokenmill.kv_transfer.aggregate import KVOutputAggregator


def test_a_transfer_is_reported_once_every_rank_reported_it_and_failed_if_any_failed():
    aggregator = KVOutputAggregator(2)
    step1 = aggregator.merge([KVConnectorOutput(finished_recving={"a", "b"}, finished_sending={"p"}),
                              KVConnectorOutput(failed_recving={"b"})])
    assert step1 == KVConnectorOutput(failed_recving={"b"})  # rank 1 failed b; a waits for rank 1
    step2 = aggregator.merge([KVConnectorOutput(), KVConnectorOutput(finished_recving={"a"}, finished_sending={"p"})])
    assert step2 == KVConnectorOutput(finished_recving={"a"}, finished_sending={"p"})
    assert aggregator.merge([KVConnectorOutput(), KVConnectorOutput()]) == KVConnectorOutput()  # each said once
    assert aggregator.merge([None, None]) is None  # no connector
