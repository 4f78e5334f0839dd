"""The scheduler half: a consumer claims a prompt's prefix and lets its worker fetch it; a
producer tells its worker which prompt blocks each step computes (servable at once), and keeps
a finished prompt's blocks until its worker has sent them or their lease ends."""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.plugin_api import KVConnectorContext, Request, ScheduledKVRequest
from tokenmill_kv_zmq.options import BlockRef, ZmqMetadata, ZmqOptions

_KEPT_STATUSES = ("FINISHED_STOPPED", "FINISHED_LENGTH")  # an aborted or failed prompt's KV is nobody's


class ZmqScheduler:
    def __init__(self, context: KVConnectorContext) -> None:
        self.config = context.transfer_config
        self.options = ZmqOptions.parse(self.config.kv_connector_extra_config)
        if self.config.is_producer and not self.options.bind:
            raise ValueError("kv_zmq: a producer needs kv_connector_extra_config={'bind': 'tcp://HOST:PORT'}")
        if self.config.is_consumer and not self.options.peers:
            raise ValueError("kv_zmq: a consumer needs kv_connector_extra_config={'peers': ['tcp://HOST:PORT']}")
        self.block_size = context.block_size
        self._loads: dict[str, list[BlockRef]] = {}
        self._kept: set[str] = set()
        self._offered: dict[str, int] = {}  # producer: request -> prompt blocks offered so far

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """A consumer claims every whole prompt block past the local hit: whether a peer holds
        them is learnt by asking it, and a fetch that fails is recomputed."""
        if not self.config.is_consumer:
            return 0
        return max(0, (request.num_tokens - 1) // self.block_size * self.block_size - num_computed_tokens)

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        first = request.num_computed_tokens // self.block_size
        last = first + num_external_tokens // self.block_size
        self._loads[request.request_id] = [(block_ids[i], request.block_hashes[i].hex()) for i in range(first, last)]

    def build_connector_meta(self, scheduled: Sequence[ScheduledKVRequest], finished_req_ids: set[str],
                             preempted_req_ids: set[str]) -> ZmqMetadata:
        loads, self._loads = self._loads, {}
        kept, self._kept = self._kept, set()
        for req_id in finished_req_ids:
            loads.pop(req_id, None)
        for req_id in preempted_req_ids:  # its blocks are gone: offered again from the start once recomputed
            self._offered.pop(req_id, None)
        computed: dict[str, list[BlockRef]] = {}
        if self.config.is_producer:
            computed = {str(entry.request.request_id): refs for entry in scheduled
                        if (refs := self._prompt_blocks(entry))}
        return ZmqMetadata(loads, computed, kept & finished_req_ids, (finished_req_ids - kept) | preempted_req_ids)

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

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        """A producer keeps a finished prompt's blocks until its worker reports them sent (or
        their lease over)."""
        self._loads.pop(request.request_id, None)
        self._offered.pop(request.request_id, None)
        keep = (self.config.is_producer and request.status.name in _KEPT_STATUSES
                and min(request.num_computed_tokens, request.num_prompt_tokens) >= self.block_size)
        if keep:
            self._kept.add(request.request_id)
        return keep
