"""A consumer's fetch: ask every peer for a prompt's blocks, take the first intact answer."""

from __future__ import annotations

import json
import logging
import threading
import time

import zmq

from tokenmill_kv_zmq.wire import FETCH, KV, BadPayload, KVCaches, read_kv_reply

logger = logging.getLogger(__name__)


class FetchFailed(Exception):
    """No peer gave the blocks, intact, before the deadline."""


def fetch_blocks(context: zmq.Context, peers: list[str], hashes: list[str], kv_caches: KVCaches,
                 timeout_s: float, cancelled: threading.Event | None = None) -> list[list[bytes]]:
    """Each block's frames, checked, from whichever peer answers first with all of them.
    A peer that refuses, sends a bad payload or says nothing is given up on; with every peer
    given up on, or at the deadline, :class:`FetchFailed`. ``cancelled`` (a ``threading.Event``)
    ends the wait early."""
    deadline = time.monotonic() + timeout_s
    sockets = []
    poller = zmq.Poller()
    try:
        for peer in peers:
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(peer)
            sock.send_multipart([FETCH, json.dumps({"hashes": hashes}).encode()])
            poller.register(sock, zmq.POLLIN)
            sockets.append(sock)
        pending = set(sockets)
        reasons: list[str] = []
        while pending:
            if cancelled is not None and cancelled.is_set():
                raise FetchFailed("cancelled")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise FetchFailed(f"no intact answer within {timeout_s:g} s ({'; '.join(reasons) or 'silence'})")
            for sock, _event in poller.poll(int(min(remaining, 0.05) * 1000) + 1):
                parts = sock.recv_multipart()
                pending.discard(sock)
                poller.unregister(sock)
                if parts and parts[0] == KV:
                    try:
                        return read_kv_reply(parts, kv_caches, hashes)
                    except BadPayload as exc:
                        reasons.append(f"bad payload: {exc}")
                else:
                    reasons.append("a peer does not hold them")
        raise FetchFailed("; ".join(reasons))
    finally:
        for sock in sockets:
            sock.close(linger=0)
