"""A producer's server thread: answers fetches from the offered blocks, layer by layer, straight from the cache."""

from __future__ import annotations

import json
import logging
import threading
import time

import zmq

from tokenmill_kv_zmq.offers import OfferBook
from tokenmill_kv_zmq.wire import FETCH, MISSING, KVCaches, block_runs, kv_header, layer_message

logger = logging.getLogger(__name__)

_POLL_MS = 50  # how often the thread looks at its stop flag
_SEND_TIMEOUT_S = 10.0  # a consumer that stops reading mid-answer gives its blocks back after this


class KVServer(threading.Thread):
    def __init__(self, context: zmq.Context, endpoint: str, offers: OfferBook, kv_caches: KVCaches) -> None:
        super().__init__(name="kv-zmq-server", daemon=True)
        self.offers = offers
        self.kv_caches = kv_caches
        self._socket = context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(endpoint)
        self._stop_event = threading.Event()
        self.num_served = 0

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)

    def run(self) -> None:
        try:
            while not self._stop_event.is_set():
                if self._socket.poll(_POLL_MS):
                    self._answer(self._socket.recv_multipart())
        finally:
            self._socket.close(linger=0)

    def _answer(self, parts: list[bytes]) -> None:
        identity, *message = parts
        try:
            kind, body = message
            fetch = json.loads(body) if kind == FETCH else {}
            hashes = [str(h) for h in fetch["hashes"]] if kind == FETCH else None
            preferred = fetch.get("request_id")  # the request the consumer's kv_transfer_params name
        except (ValueError, KeyError, TypeError, AttributeError):
            hashes, preferred = None, None
        if not hashes:
            self._socket.send_multipart([identity, MISSING, b"{}"])
            return
        found = self.offers.begin_fetch(hashes, preferred if isinstance(preferred, str) else None)
        if found is None:
            self._socket.send_multipart([identity, MISSING, b"{}"])
            return
        req_id, block_ids = found
        sent = False
        try:
            self._send_layers(identity, hashes, block_ids)
            sent = True
            self.num_served += 1
        except (zmq.ZMQError, zmq.NotDone) as exc:
            logger.warning("kv_zmq: sending the KV of %s failed: %s", req_id, exc)
        finally:
            self.offers.end_fetch(req_id, sent)

    def _send_layers(self, identity: bytes, hashes: list[str], block_ids: list[int]) -> None:
        """The header, then each layer's blocks as views of the cache (zmq sends them from its I/O
        thread while the next layer's digest is computed); returns once zmq let go of them all,
        for the cache must not change before."""
        runs = block_runs(block_ids)
        self._socket.send_multipart([identity, *kv_header(self.kv_caches, hashes, runs)])
        trackers = [self._socket.send_multipart([identity, *layer_message(self.kv_caches, layer, runs)],
                                                copy=False, track=True)
                    for layer in range(len(self.kv_caches))]
        deadline = time.monotonic() + _SEND_TIMEOUT_S
        for tracker in trackers:
            tracker.wait(max(0.0, deadline - time.monotonic()))
