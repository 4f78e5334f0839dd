"""The worker half: block files read into the paged cache before a forward, written after it."""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from tokenmill.plugin_api import AttentionMetadata, KVCache, KVConnectorContext, KVConnectorOutput
from tokenmill_kv_shared_storage.block_file import BadBlockFile, read_block, scatter_block, write_block
from tokenmill_kv_shared_storage.metadata import BlockRef, SharedStorageMetadata, block_file, storage_folder

logger = logging.getLogger(__name__)

_READ_THREADS = 2  # file reads and checksums release the GIL: they run beside the engine's steps


class SharedStorageWorker:
    def __init__(self, context: KVConnectorContext) -> None:
        self.folder = storage_folder(context.transfer_config.kv_connector_extra_config)
        self.rank, self.num_ranks = context.rank, context.engine_config.tensor_parallel_size
        self.kv_caches: list[KVCache] = []
        self._metadata = SharedStorageMetadata()
        self._output = KVConnectorOutput()
        self._pool = ThreadPoolExecutor(_READ_THREADS, thread_name_prefix="kv-storage-read")
        self._reads: dict[str, tuple[list[BlockRef], Future[list[torch.Tensor] | None]]] = {}
        # Counters, for a test or a benchmark to read: blocks read and written, files refused.
        self.num_blocks_loaded = self.num_blocks_saved = self.num_bad_files = 0
        self.bytes_loaded = self.bytes_saved = 0

    def register_kv_caches(self, kv_caches: list[KVCache]) -> None:
        self.kv_caches = kv_caches

    def bind_connector_metadata(self, metadata: Any) -> None:
        self._metadata = metadata if metadata is not None else SharedStorageMetadata()
        for req_id in self._metadata.cancelled:  # ended while loading: its blocks are written no more
            read = self._reads.pop(req_id, None)
            if read is not None:
                read[1].cancel()

    def start_load_kv(self) -> None:
        """Start reading each load's files on a thread; they are copied into the cache, on this
        thread between forwards, once all of a request's are read and checked."""
        for req_id, blocks in self._metadata.loads.items():
            self._reads[req_id] = (blocks, self._pool.submit(self._read_request, req_id, blocks))

    def _read_request(self, req_id: str, blocks: list[BlockRef]) -> list[torch.Tensor] | None:
        """Every block's checked payload, or None (the request fails) at the first bad file."""
        payloads = []
        for _block_id, block_hash in blocks:
            path = block_file(self.folder, block_hash, self.rank, self.num_ranks)
            try:
                payloads.append(read_block(path, self.kv_caches))
            except BadBlockFile as exc:
                logger.warning("request %s: KV block %s refused, the prompt is computed instead: %s",
                               req_id, block_hash[:16], exc)
                self.num_bad_files += 1
                path.unlink(missing_ok=True)  # a damaged file would be offered again
                return None
        return payloads

    def _finish_reads(self) -> None:
        for req_id in [r for r, (_, future) in self._reads.items() if future.done()]:
            blocks, future = self._reads.pop(req_id)
            payloads = future.result()
            if payloads is None:
                self._output.failed_recving.add(req_id)
                continue
            for (block_id, _hash), payload in zip(blocks, payloads, strict=True):
                scatter_block(payload, self.kv_caches, block_id)
                self.bytes_loaded += payload.numel() * payload.element_size()
            self.num_blocks_loaded += len(payloads)
            self._output.finished_recving.add(req_id)

    def wait_for_layer_load(self, layer_index: int) -> None:
        """Loads finish in ``start_load_kv``: nothing to wait for per layer."""

    def save_kv_layer(self, layer_index: int, kv_cache: KVCache, metadata: AttentionMetadata) -> None:
        """A block file holds every layer: written in ``wait_for_save``."""

    def wait_for_save(self) -> None:
        for block_id, block_hash in self._metadata.saves:
            path = block_file(self.folder, block_hash, self.rank, self.num_ranks)
            if path.exists():  # the same prefix, written before (by this engine or another)
                continue
            self.bytes_saved += write_block(path, self.kv_caches, block_id)
            self.num_blocks_saved += 1

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        self._finish_reads()
        output, self._output = self._output, KVConnectorOutput()
        return output

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
