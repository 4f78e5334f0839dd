"""A consumer's fetch: ask its peers (or the producer the params name) for a prompt's blocks and
copy the first intact answer into them, layer by layer as it arrives."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import recv_monitor_message

from tokenmill_kv_zmq.wire import FETCH, MISSING, BadPayload, KVCaches, copy_layer, read_header, read_layer

logger = logging.getLogger(__name__)


class FetchFailed(Exception):
    """No peer gave the blocks, intact, before the deadline (or the fetch was cancelled)."""


@dataclass
class FetchTarget:
    """Where a fetch writes: blocks ``block_ids`` (in the order of ``hashes``) of ``kv_caches``.

    ``guard`` is held while a layer is written and ``cancelled`` is looked at under it, so one
    who sets ``cancelled`` and then takes ``guard`` knows that nothing more is written.
    ``on_layer(i)``: layer ``i`` is in (for a counter)."""

    hashes: list[str]
    block_ids: list[int]
    kv_caches: KVCaches
    cancelled: threading.Event = field(default_factory=threading.Event)
    guard: threading.Lock = field(default_factory=threading.Lock)
    on_layer: Callable[[int], None] | None = None


@dataclass
class _Answer:
    """One peer's answer as it arrives: the runs its header announced, the next layer due."""

    peer: str
    runs: list[int] | None = None
    next_layer: int = 0


def fetch_layers(context: zmq.Context, peers: Sequence[str], target: FetchTarget, timeout_s: float,
                 remote_request_id: str | None = None) -> int:
    """Load the blocks from whichever peer first announces all of them, layer by layer (each
    checked, then copied in while zmq receives the next); the bytes loaded. A peer that refuses
    the connection, says it lacks them, sends a bad layer or stops mid-answer is given up on
    (another's answer is then taken from its first layer); with every peer given up on, at the
    deadline, or once ``target.cancelled`` is set, :class:`FetchFailed`: the blocks may hold
    part of an answer, which nobody may use. ``remote_request_id``: the producer's request that
    holds them, when the kv_transfer_params say so."""
    deadline = time.monotonic() + timeout_s
    body = json.dumps({"hashes": target.hashes, "request_id": remote_request_id}).encode()
    answers: dict[zmq.Socket, _Answer] = {}
    monitors: dict[zmq.Socket, zmq.Socket] = {}  # a peer's connection events -> its socket
    poller = zmq.Poller()
    pending: set[zmq.Socket] = set()  # asked, answer not given up on
    current: zmq.Socket | None = None  # the peer whose answer is being loaded (the others wait unread)
    reasons: list[str] = []
    loaded = 0

    def give_up(sock: zmq.Socket, reason: str) -> None:
        nonlocal current
        pending.discard(sock)
        reasons.append(f"{answers[sock].peer}: {reason}")
        if current is None or sock is current:  # else it is not polled now
            poller.unregister(sock)
        if sock is current:
            current = None
            for other in pending:  # their answers are queued, unread: take the first one complete
                poller.register(other, zmq.POLLIN)

    try:
        for peer in peers:
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            monitor = sock.get_monitor_socket(zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED)
            answers[sock] = _Answer(peer)
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
            if target.cancelled.is_set():
                raise FetchFailed("cancelled")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise FetchFailed(f"no intact answer within {timeout_s:g} s ({'; '.join(reasons) or 'silence'})")
            for sock, _event in poller.poll(int(min(remaining, 0.05) * 1000) + 1):
                if sock in monitors:  # refused, or gone mid-answer: no (more) answer will come
                    recv_monitor_message(sock)
                    peer_sock = monitors[sock]
                    if peer_sock in pending and not peer_sock.poll(0):
                        give_up(peer_sock, "connection refused or lost")
                    continue
                if sock not in pending or (current is not None and sock is not current):
                    continue
                answer = answers[sock]
                parts = sock.recv_multipart(copy=False)
                try:
                    if answer.runs is None:
                        if parts and parts[0].bytes == MISSING:
                            give_up(sock, "does not hold them")
                            continue
                        answer.runs = read_header(parts, target.kv_caches, target.hashes)
                        current = sock
                        for other in pending - {sock}:
                            poller.unregister(other)
                        continue
                    loaded += _load_layer(parts, target, answer)
                except BadPayload as exc:
                    give_up(sock, f"bad payload: {exc}")
                    continue
                if answer.next_layer == len(target.kv_caches):
                    return loaded
        raise FetchFailed("; ".join(reasons) or "no peer to ask")
    finally:
        for monitor, sock in monitors.items():
            sock.disable_monitor()
            monitor.close(linger=0)
        for sock in answers:
            sock.close(linger=0)


def _load_layer(parts: list[zmq.Frame], target: FetchTarget, answer: _Answer) -> int:
    """Check the answer's next layer and copy it in; its bytes."""
    assert answer.runs is not None
    layer = answer.next_layer
    frames = read_layer(parts, target.kv_caches, layer, answer.runs)
    with target.guard:
        if target.cancelled.is_set():  # its blocks may be another request's now
            raise FetchFailed("cancelled")
        copy_layer(frames, target.kv_caches[layer], answer.runs, target.block_ids)
    answer.next_layer += 1
    if target.on_layer is not None:
        target.on_layer(layer)
    return sum(len(frame.buffer) for frame in frames)
