"""The scheduler half: a consumer claims a prompt's prefix and lets its worker fetch it; a
producer tells its worker which prompt blocks each step computes (servable at once), and keeps
a finished prompt's blocks until its worker has sent them or their lease ends.

``kv_transfer_params`` steer both (``tokenmill.kv_transfer.params``): a producer answers a
request that asked ``do_remote_decode`` with where its blocks are (``remote_host``,
``remote_port``, ``remote_request_id``, ``remote_block_ids``) and frees at once the blocks of
one that said ``do_remote_decode: false``; a consumer fetches from exactly the producer the
params name, loads nothing for ``do_remote_prefill: false``, and asks its configured peers for
a request without an address (a request without params: today's hash lookup)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from tokenmill.plugin_api import KVConnectorContext, KVTransferParams, Request, ScheduledKVRequest
from tokenmill_kv_zmq.options import BlockRef, FetchSource, ZmqMetadata, ZmqOptions, endpoint

_KEPT_STATUSES = ("FINISHED_STOPPED", "FINISHED_LENGTH")  # an aborted or failed prompt's KV is nobody's


class ZmqScheduler:
    def __init__(self, context: KVConnectorContext) -> None:
        self.config = context.transfer_config
        self.options = ZmqOptions.parse(self.config.kv_connector_extra_config)
        if self.config.is_producer and not self.options.bind:
            raise ValueError("kv_zmq: a producer needs kv_connector_extra_config={'bind': 'tcp://HOST:PORT'}")
        self.address = self.options.advertised_address() if self.config.is_producer else None
        self.engine_id = uuid.uuid4().hex  # names this producer in its kv_transfer_params
        self.block_size = context.block_size
        self._loads: dict[str, list[BlockRef]] = {}
        self._sources: dict[str, FetchSource] = {}
        self._kept: set[str] = set()
        self._offered: dict[str, int] = {}  # producer: request -> prompt blocks offered so far

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """A consumer claims every whole prompt block past the local hit when it knows a producer
        to ask: whether it holds them is learnt by asking it, and a fetch that fails is recomputed."""
        if not self.config.is_consumer or not self._source(request).peers:
            return 0
        return max(0, (request.num_tokens - 1) // self.block_size * self.block_size - num_computed_tokens)

    def _source(self, request: Request) -> FetchSource:
        """The producer the request's params name; else the configured peers; none for do_remote_prefill false."""
        params = KVTransferParams.of(request)
        if params is None:
            return FetchSource(tuple(self.options.peers))
        if params.do_remote_prefill is False:
            return FetchSource(())
        if params.remote_host is not None and params.remote_port is not None:
            return FetchSource((endpoint(params.remote_host, params.remote_port),), params.remote_request_id)
        return FetchSource(tuple(self.options.peers), params.remote_request_id)

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        first = request.num_computed_tokens // self.block_size
        last = first + num_external_tokens // self.block_size
        self._loads[request.request_id] = [(block_ids[i], request.block_hashes[i].hex()) for i in range(first, last)]
        self._sources[request.request_id] = self._source(request)

    def build_connector_meta(self, scheduled: Sequence[ScheduledKVRequest], finished_req_ids: set[str],
                             preempted_req_ids: set[str]) -> ZmqMetadata:
        loads, self._loads = self._loads, {}
        sources, self._sources = self._sources, {}
        kept, self._kept = self._kept, set()
        for req_id in finished_req_ids:
            loads.pop(req_id, None)
            sources.pop(req_id, None)
        for req_id in preempted_req_ids:  # its blocks are gone: offered again from the start once recomputed
            self._offered.pop(req_id, None)
        computed: dict[str, list[BlockRef]] = {}
        if self.config.is_producer:
            computed = {str(entry.request.request_id): refs for entry in scheduled
                        if (refs := self._prompt_blocks(entry))}
        return ZmqMetadata(loads, computed, kept & finished_req_ids, (finished_req_ids - kept) | preempted_req_ids,
                           sources)

    def _prompt_blocks(self, entry: ScheduledKVRequest) -> list[BlockRef]:
        """The whole prompt blocks whose KV is written once this step ran and that were not
        offered yet: those this step computes, and at first the ones a prefix-cache hit gave."""
        request = entry.request
        first = self._offered.get(request.request_id, 0)
        end = min(entry.num_computed_tokens + entry.num_new_tokens, request.num_prompt_tokens) // self.block_size
        end = min(end, len(request.block_hashes), len(entry.block_ids))
        if end <= first:
            return []
        self._offered[request.request_id] = end
        return [(entry.block_ids[i], request.block_hashes[i].hex()) for i in range(first, end)]

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A producer keeps a finished prompt's blocks until its worker reports them sent (or
        their lease over), unless its params said ``do_remote_decode: false``; to one that asked
        ``do_remote_decode`` it answers where they are."""
        self._loads.pop(request.request_id, None)
        self._sources.pop(request.request_id, None)
        self._offered.pop(request.request_id, None)
        params = KVTransferParams.of(request)
        num_blocks = min(request.num_computed_tokens, request.num_prompt_tokens) // self.block_size
        keep = (self.config.is_producer and request.status.name in _KEPT_STATUSES and num_blocks > 0
                and (params is None or params.do_remote_decode is not False))
        if keep:
            self._kept.add(request.request_id)
        if params is None or not params.do_remote_decode or not self.config.is_producer:
            return keep, None
        return keep, self._answer(request, block_ids[:num_blocks] if keep else [])

    def _answer(self, request: Request, block_ids: list[int]) -> dict[str, Any]:
        """The kv_transfer_params a decode engine needs to fetch ``block_ids`` (none: compute the prompt)."""
        if not block_ids:
            return {"do_remote_prefill": False, "do_remote_decode": False}
        assert self.address is not None
        host, port = self.address
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                "remote_host": host, "remote_port": port, "remote_request_id": request.request_id,
                "remote_block_ids": block_ids}
