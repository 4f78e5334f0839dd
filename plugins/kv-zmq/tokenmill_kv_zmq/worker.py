"""The worker half: a producer serves its offered blocks from a thread, layer by layer; a consumer
fetches on a thread pool, each fetch copying layer ``i`` into its blocks as soon as it arrived
and was checked, while the next layer is still on its way."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import zmq

from tokenmill.plugin_api import AttentionMetadata, KVCache, KVConnectorContext, KVConnectorOutput
from tokenmill_kv_zmq.fetch import FetchFailed, FetchTarget, fetch_layers
from tokenmill_kv_zmq.offers import OfferBook
from tokenmill_kv_zmq.options import FetchSource, ZmqMetadata, ZmqOptions, rank_endpoint
from tokenmill_kv_zmq.server import KVServer

logger = logging.getLogger(__name__)

_FETCH_THREADS = 4


class _Fetch:
    def __init__(self, target: FetchTarget, future: Future[tuple[int, float]]) -> None:
        self.target = target
        self.future = future

    def cancel(self) -> None:
        """Stop writing its blocks: once this returns, no layer of it is written any more."""
        self.target.cancelled.set()
        self.future.cancel()
        with self.target.guard:  # a layer being copied in now is done after this
            pass


class ZmqWorker:
    def __init__(self, context: KVConnectorContext) -> None:
        self.config = context.transfer_config
        self.options = ZmqOptions.parse(self.config.kv_connector_extra_config)
        self.rank = context.rank  # under tensor parallelism: its own heads, on the base ports plus its rank
        self.kv_caches: list[KVCache] = []
        self._zmq = zmq.Context()
        self._metadata = ZmqMetadata()
        self.offers = OfferBook(self.options.lease_s)
        self._server: KVServer | None = None
        self._pool = ThreadPoolExecutor(_FETCH_THREADS, thread_name_prefix="kv-zmq-fetch")
        self._fetches: dict[str, _Fetch] = {}
        self._output = KVConnectorOutput()
        # Counters, for a test or a benchmark to read.
        self.num_fetched = self.num_failed_fetches = 0
        self.bytes_fetched = 0
        self.seconds_fetching = 0.0  # wall time of the fetches that loaded, from the ask to the last layer in
        self.num_layers_loaded = 0  # layers copied in, by every fetch (a failed one's too)
        self._counter_lock = threading.Lock()

    def register_kv_caches(self, kv_caches: list[KVCache]) -> None:
        self.kv_caches = kv_caches
        if self.config.is_producer and self._server is None:
            assert self.options.bind is not None
            self._server = KVServer(self._zmq, rank_endpoint(self.options.bind, self.rank), self.offers, kv_caches)
            self._server.start()

    def bind_connector_metadata(self, metadata: Any) -> None:
        """Before this step writes anything: drop what ended, start what the scheduler asks."""
        meta: ZmqMetadata = metadata if metadata is not None else ZmqMetadata()
        self._metadata = meta
        for req_id in meta.kept:
            self.offers.keep(req_id)
        for req_id in meta.cancelled:
            self.offers.cancel(req_id)
            fetch = self._fetches.pop(req_id, None)
            if fetch is not None:  # its blocks may be another request's in this very step
                fetch.cancel()

    def start_load_kv(self) -> None:
        for req_id, blocks in self._metadata.loads.items():
            source = self._metadata.sources.get(req_id) or FetchSource(tuple(self.options.peers))
            peers = [rank_endpoint(peer, self.rank) for peer in source.peers]
            target = FetchTarget([h for _, h in blocks], [block_id for block_id, _ in blocks], self.kv_caches,
                                 on_layer=self._count_layer)
            future = self._pool.submit(self._timed_fetch, peers, target, source.remote_request_id)
            self._fetches[req_id] = _Fetch(target, future)

    def _timed_fetch(self, peers: list[str], target: FetchTarget, remote_request_id: str | None) -> tuple[int, float]:
        started = time.perf_counter()
        loaded = fetch_layers(self._zmq, peers, target, self.options.fetch_timeout_s, remote_request_id)
        return loaded, time.perf_counter() - started

    def _count_layer(self, _layer: int) -> None:
        with self._counter_lock:
            self.num_layers_loaded += 1

    def wait_for_layer_load(self, layer_index: int) -> None:
        """Nothing to wait for: the core runs a request only once its load is reported complete
        (it waits in WAITING_FOR_REMOTE_KVS meanwhile), so no forward reads a block being loaded.
        The layers still overlap: a fetch copies layer i in while layer i + 1 arrives."""

    def save_kv_layer(self, layer_index: int, kv_cache: KVCache, metadata: AttentionMetadata) -> None:
        """Blocks are served from the cache itself, layer by layer, when asked: nothing to copy here."""

    def wait_for_save(self) -> None:
        """The forward wrote this step's prompt blocks: offer them."""
        for req_id, refs in self._metadata.computed.items():
            self.offers.add(req_id, refs)

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        for req_id in [r for r, f in self._fetches.items() if f.future.done()]:
            self._finish_fetch(req_id, self._fetches.pop(req_id))
        self._output.finished_sending |= self.offers.take_sent()
        output, self._output = self._output, KVConnectorOutput()
        return output

    def _finish_fetch(self, req_id: str, fetch: _Fetch) -> None:
        """A fetch has ended: every layer is in its blocks, or it failed (what it wrote is garbage)."""
        try:
            loaded, seconds = fetch.future.result()
        except Exception as exc:  # FetchFailed, or a fault in the fetch thread: the prompt is computed either way
            log = logger.warning if isinstance(exc, FetchFailed) else logger.exception
            log("kv_zmq: request %s: no KV from the producers (%s); computing its prompt", req_id, exc)
            self.num_failed_fetches += 1
            self._output.failed_recving.add(req_id)
            return
        self.num_fetched += 1
        self.bytes_fetched += loaded
        self.seconds_fetching += seconds
        self._output.finished_recving.add(req_id)

    def shutdown(self) -> None:
        for fetch in self._fetches.values():
            fetch.target.cancelled.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._server is not None:
            self._server.stop()
        self._zmq.term()
