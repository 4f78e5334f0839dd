"""A consumer's fetch: ask its peers (or the producer the params name) for a prompt's blocks, take the first intact answer."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence

import zmq
from zmq.utils.monitor import recv_monitor_message

from tokenmill_kv_zmq.wire import FETCH, KV, BadPayload, KVCaches, read_kv_reply

logger = logging.getLogger(__name__)


class FetchFailed(Exception):
    """No peer gave the blocks, intact, before the deadline."""


def fetch_blocks(context: zmq.Context, peers: Sequence[str], hashes: list[str], kv_caches: KVCaches,
                 timeout_s: float, cancelled: threading.Event | None = None,
                 remote_request_id: str | None = None) -> list[list[bytes]]:
    """Each block's frames, checked, from whichever peer answers first with all of them.
    A peer that refuses the connection, says it lacks them, sends a bad payload or says nothing
    is given up on; with every peer given up on, or at the deadline, :class:`FetchFailed`.
    ``cancelled`` (a ``threading.Event``) ends the wait early. ``remote_request_id``: the
    producer's request that holds them, when the kv_transfer_params say so."""
    deadline = time.monotonic() + timeout_s
    body = json.dumps({"hashes": hashes, "request_id": remote_request_id}).encode()
    peers_of: dict[zmq.Socket, str] = {}
    monitors: dict[zmq.Socket, zmq.Socket] = {}  # a peer's connection events -> its socket
    poller = zmq.Poller()
    pending: set[zmq.Socket] = set()  # asked, no answer yet
    reasons: list[str] = []
    try:
        for peer in peers:
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            monitor = sock.get_monitor_socket(zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED)
            peers_of[sock] = peer
            monitors[monitor] = sock
            poller.register(monitor, zmq.POLLIN)
            try:
                sock.connect(peer)
            except zmq.ZMQError as exc:  # a malformed address (the params may name anything)
                reasons.append(f"{peer}: {exc}")
                continue
            sock.send_multipart([FETCH, body])
            poller.register(sock, zmq.POLLIN)
            pending.add(sock)
        while pending:
            if cancelled is not None and cancelled.is_set():
                raise FetchFailed("cancelled")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise FetchFailed(f"no intact answer within {timeout_s:g} s ({'; '.join(reasons) or 'silence'})")
            for sock, _event in poller.poll(int(min(remaining, 0.05) * 1000) + 1):
                if sock in monitors:  # refused, or gone mid-answer: no answer will come
                    recv_monitor_message(sock)
                    peer_sock = monitors[sock]
                    if peer_sock in pending and not peer_sock.poll(0):
                        pending.discard(peer_sock)
                        reasons.append(f"{peers_of[peer_sock]}: connection refused or lost")
                    continue
                if sock not in pending:
                    continue
                parts = sock.recv_multipart()
                pending.discard(sock)
                if parts and parts[0] == KV:
                    try:
                        return read_kv_reply(parts, kv_caches, hashes)
                    except BadPayload as exc:
                        reasons.append(f"bad payload: {exc}")
                else:
                    reasons.append("a peer does not hold them")
        raise FetchFailed("; ".join(reasons) or "no peer to ask")
    finally:
        for monitor, sock in monitors.items():
            sock.disable_monitor()
            monitor.close(linger=0)
        for sock in peers_of:
            sock.close(linger=0)
