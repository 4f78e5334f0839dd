"""A producer's servable blocks: which request's block holds each hash, and each kept request's lease.

Shared by the worker's step (which adds and withdraws) and the server thread (which serves);
one lock guards it. A request's blocks are withdrawn only once no fetch is reading them, so the
engine never reuses a block that is being sent.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

from tokenmill_kv_zmq.options import BlockRef


class OfferBook:
    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self._lock = threading.Condition()
        self._owners: dict[str, dict[str, int]] = {}  # hash -> {request: block id}
        self._blocks: dict[str, list[str]] = {}  # request -> its offered hashes
        self._leases: dict[str, float] = {}  # kept request -> when its lease ends (monotonic)
        self._in_service: Counter[str] = Counter()  # request -> fetches reading its blocks now
        self._served: set[str] = set()  # requests whose blocks a consumer fetched
        self._sent: set[str] = set()  # kept requests done with (fetched, or the lease ended): to report

    def add(self, req_id: str, refs: list[BlockRef]) -> None:
        with self._lock:
            for block_id, block_hash in refs:
                self._owners.setdefault(block_hash, {})[req_id] = block_id
                self._blocks.setdefault(req_id, []).append(block_hash)

    def keep(self, req_id: str) -> None:
        """``req_id`` finished with its blocks kept: fetched already, it is done; else its lease starts."""
        with self._lock:
            if req_id in self._served or req_id not in self._blocks:
                self._withdraw(req_id)
                self._sent.add(req_id)
            else:
                self._leases[req_id] = time.monotonic() + self.lease_s

    def cancel(self, req_id: str) -> None:
        """``req_id`` ended without its blocks kept: offer them no more."""
        with self._lock:
            self._withdraw(req_id)

    def take_sent(self) -> set[str]:
        """Kept requests fetched since the last call, or whose lease ended (their blocks may go)."""
        with self._lock:
            now = time.monotonic()
            for req_id in [r for r, end in self._leases.items() if end <= now or r in self._served]:
                self._withdraw(req_id)
                self._sent.add(req_id)
            sent, self._sent = self._sent, set()
            return sent

    def begin_fetch(self, hashes: list[str], preferred: str | None = None) -> tuple[str, list[int]] | None:
        """A request holding every one of ``hashes`` (``preferred`` if it does) and its block ids,
        marked in service; None if none does."""
        with self._lock:
            candidates: set[str] | None = None
            for block_hash in hashes:
                owners = set(self._owners.get(block_hash, ()))
                candidates = owners if candidates is None else candidates & owners
                if not candidates:
                    return None
            if not candidates:
                return None
            req_id = preferred if preferred in candidates else min(candidates)
            self._in_service[req_id] += 1
            return req_id, [self._owners[h][req_id] for h in hashes]

    def end_fetch(self, req_id: str, sent: bool) -> None:
        with self._lock:
            self._in_service[req_id] -= 1
            if self._in_service[req_id] <= 0:
                del self._in_service[req_id]
            if sent:
                self._served.add(req_id)
            self._lock.notify_all()

    def num_offered(self) -> int:
        with self._lock:
            return len(self._blocks)

    def _withdraw(self, req_id: str) -> None:
        """Under the lock: stop offering ``req_id``'s blocks, once no fetch reads them."""
        while self._in_service.get(req_id):
            self._lock.wait(timeout=1.0)
        for block_hash in self._blocks.pop(req_id, []):
            owners = self._owners.get(block_hash)
            if owners is not None:
                owners.pop(req_id, None)
                if not owners:
                    del self._owners[block_hash]
        self._leases.pop(req_id, None)
        self._served.discard(req_id)
