"""Moving KV cache between engines: disaggregated prefill/decode and external KV tiers.

A connector (``tokenmill_register_kv_connectors``) has two halves: a scheduler side in the
engine process (:class:`KVConnectorScheduler`) and a worker side in each worker
(:class:`KVConnectorWorker`); see :mod:`tokenmill.kv_transfer.connector` for the contract.
"""

from tokenmill.kv_transfer.config import KVTransferConfig
from tokenmill.kv_transfer.connector import (
    KVConnectorContext,
    KVConnectorOutput,
    KVConnectorScheduler,
    KVConnectorWorker,
    ScheduledKVRequest,
)
from tokenmill.kv_transfer.params import KVTransferParams

__all__ = [
    "KVConnectorContext",
    "KVConnectorOutput",
    "KVConnectorScheduler",
    "KVConnectorWorker",
    "KVTransferConfig",
    "KVTransferParams",
    "ScheduledKVRequest",
]
