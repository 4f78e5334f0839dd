"""The scheduler half: which prefix blocks a folder holds, and what each step loads and saves."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenmill.plugin_api import KVConnectorContext, KVTransferParams, Request, ScheduledKVRequest
from tokenmill_kv_shared_storage.metadata import BlockRef, SharedStorageMetadata, block_file, storage_folder


class SharedStorageScheduler:
    def __init__(self, context: KVConnectorContext) -> None:
        self.config = context.transfer_config
        self.block_size = context.block_size
        self.folder = storage_folder(self.config.kv_connector_extra_config)
        self.num_ranks = context.engine_config.tensor_parallel_size  # each rank writes its own file of a block
        self._loads: dict[str, list[BlockRef]] = {}  # allocated since the last step, to load

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """The run of blocks after the local hit whose files exist, every rank's (their content
        is checked when the workers read them), leaving the last prompt token to compute."""
        if not self.config.is_consumer:
            return 0
        first = num_computed_tokens // self.block_size
        last = (request.num_tokens - 1) // self.block_size
        found = 0
        for block_hash in request.block_hashes[first:last]:
            if not all(block_file(self.folder, block_hash.hex(), rank, self.num_ranks).is_file()
                       for rank in range(self.num_ranks)):
                break
            found += 1
        return found * self.block_size

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        first = request.num_computed_tokens // self.block_size
        last = first + num_external_tokens // self.block_size
        self._loads[request.request_id] = [(block_ids[i], request.block_hashes[i].hex()) for i in range(first, last)]

    def build_connector_meta(self, scheduled: Sequence[ScheduledKVRequest], finished_req_ids: set[str],
                             preempted_req_ids: set[str]) -> SharedStorageMetadata:
        loads, self._loads = self._loads, {}
        for req_id in finished_req_ids:
            loads.pop(req_id, None)
        saves = [ref for entry in scheduled for ref in self._completed_blocks(entry)] if self.config.is_producer else []
        return SharedStorageMetadata(loads, saves, finished_req_ids | preempted_req_ids)

    def _completed_blocks(self, entry: ScheduledKVRequest) -> list[BlockRef]:
        """The blocks whose last token this step computes (their files are written after it)."""
        first = entry.num_computed_tokens // self.block_size
        end = min((entry.num_computed_tokens + entry.num_new_tokens) // self.block_size,
                  len(entry.request.block_hashes), len(entry.block_ids))
        return [(entry.block_ids[i], entry.request.block_hashes[i].hex()) for i in range(first, end)]

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Every save is written within its step: nothing to keep. A request that asked
        ``do_remote_decode`` is told its blocks are in the folder (a consumer finds them by their
        hashes, so the params name no producer); a consumer loads what the folder holds whatever
        its params say (the folder is a tier, not a peer that could be gone)."""
        self._loads.pop(request.request_id, None)
        params = KVTransferParams.of(request)
        if params is None or not params.do_remote_decode or not self.config.is_producer:
            return False, None
        return False, {"do_remote_prefill": True, "do_remote_decode": False}
