"""The ``kv_zmq`` KV connector: prompt KV pulled from a producer engine over ZeroMQ.

``kv_transfer_config={"kv_connector": "kv_zmq", "kv_role": ..., "kv_connector_extra_config":
{...}}`` with, for a producer, ``"bind": "tcp://HOST:PORT"`` (where it serves; ``"advertise_host"``
if consumers reach it by another name than the bind's) and, for a consumer, optionally
``"peers": ["tcp://HOST:PORT", ...]`` (the producers it asks for a request whose
``kv_transfer_params`` name none: a producer answers a ``do_remote_decode`` request with its
address, and the router hands that to the consumer). Options:
``"lease_s"`` (default 30: how long a producer keeps a finished prompt's blocks for a consumer
that has not fetched them) and ``"fetch_timeout_s"`` (default 5: how long a consumer waits for a
complete, checked answer before computing the prompt itself).

Under tensor parallelism rank ``r`` serves and fetches its own KV heads on the ``bind`` (and
peer) port plus ``r``: a producer takes as many consecutive ports as it has ranks.

A producer keeps the blocks of each prompt it finishes and offers them under their prefix-cache
hashes; a consumer asks its peers for the hashes of a prompt's prefix, and the one that holds
them all sends them, layer by layer, straight from its paged cache; the consumer copies each
layer into its blocks as it arrives (one copy, from the buffer zmq received it in), while the
next is on its way. Every layer's payload carries a checksum; a short or corrupt payload, a
refusal, a dead or silent peer all end in the same place: the consumer computes the prompt (the
request runs only once every layer is in, so a partial load is never read). A producer frees a
prompt's blocks once it has sent them, or when its lease ends.
"""

from __future__ import annotations

from tokenmill.plugin_api import KVConnectorSpec, hookimpl

TOKENMILL_PLUGIN_API = 1


@hookimpl
def tokenmill_register_kv_connectors() -> list[KVConnectorSpec]:
    return [KVConnectorSpec(
        name="kv_zmq",
        scheduler_qualname="tokenmill_kv_zmq.scheduler:ZmqScheduler",
        worker_qualname="tokenmill_kv_zmq.worker:ZmqWorker",
        tensor_parallel=True,  # rank r serves and fetches its own KV heads on the base port + r
    )]
