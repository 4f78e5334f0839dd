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
    fetch = _Fetch(context, target)
    try:
        fetch.ask(peers, json.dumps({"hashes": target.hashes, "request_id": remote_request_id}).encode())
        return fetch.wait(time.monotonic() + timeout_s, timeout_s)
    finally:
        fetch.close()


class _Fetch:
    """One fetch's sockets and answers. Every asked peer answers at once, but only one answer
    is read at a time: once a peer's header says it holds the blocks, the others wait unread
    (zmq queues them) until that peer is given up on, so no layer is ever written twice."""

    def __init__(self, context: zmq.Context, target: FetchTarget) -> None:
        self.context = context
        self.target = target
        self.answers: dict[zmq.Socket, _Answer] = {}
        self.monitors: dict[zmq.Socket, zmq.Socket] = {}  # a peer's connection events -> its socket
        self.poller = zmq.Poller()
        self.pending: set[zmq.Socket] = set()  # asked, answer not given up on
        self.current: zmq.Socket | None = None  # the peer whose answer is being loaded
        self.reasons: list[str] = []
        self.loaded = 0

    def ask(self, peers: Sequence[str], body: bytes) -> None:
        for peer in peers:
            sock = self.context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            monitor = sock.get_monitor_socket(zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED)
            self.answers[sock] = _Answer(peer)
            self.monitors[monitor] = sock
            self.poller.register(monitor, zmq.POLLIN)
            try:
                sock.connect(peer)
            except zmq.ZMQError as exc:  # a malformed address (the params may name anything)
                self.reasons.append(f"{peer}: {exc}")
                continue
            sock.send_multipart([FETCH, body])
            self.poller.register(sock, zmq.POLLIN)
            self.pending.add(sock)

    def wait(self, deadline: float, timeout_s: float) -> int:
        """Poll until one answer is complete (its bytes), or raise FetchFailed."""
        while self.pending:
            if self.target.cancelled.is_set():
                raise FetchFailed("cancelled")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise FetchFailed(f"no intact answer within {timeout_s:g} s ({'; '.join(self.reasons) or 'silence'})")
            for sock, _event in self.poller.poll(int(min(remaining, 0.05) * 1000) + 1):
                if sock in self.monitors:
                    self._connection_event(sock)
                elif self._message(sock):
                    return self.loaded
        raise FetchFailed("; ".join(self.reasons) or "no peer to ask")

    def _connection_event(self, monitor: zmq.Socket) -> None:
        """Refused, or gone mid-answer: no (more) answer will come, unless it is already queued."""
        recv_monitor_message(monitor)
        sock = self.monitors[monitor]
        if sock in self.pending and not sock.poll(0):
            self._give_up(sock, "connection refused or lost")

    def _message(self, sock: zmq.Socket) -> bool:
        """Read one message of ``sock``'s answer; whether the answer is now complete."""
        if sock not in self.pending or (self.current is not None and sock is not self.current):
            return False
        answer = self.answers[sock]
        parts = sock.recv_multipart(copy=False)
        try:
            if answer.runs is None:
                self._header(sock, answer, parts)
                return False
            self.loaded += _load_layer(parts, self.target, answer)
        except BadPayload as exc:
            self._give_up(sock, f"bad payload: {exc}")
            return False
        return answer.next_layer == len(self.target.kv_caches)

    def _header(self, sock: zmq.Socket, answer: _Answer, parts: list[zmq.Frame]) -> None:
        """A first message: "missing", or the header of an answer, which is then the one read."""
        if parts and parts[0].bytes == MISSING:
            self._give_up(sock, "does not hold them")
            return
        answer.runs = read_header(parts, self.target.kv_caches, self.target.hashes)
        self.current = sock
        for other in self.pending - {sock}:
            self.poller.unregister(other)

    def _give_up(self, sock: zmq.Socket, reason: str) -> None:
        self.pending.discard(sock)
        self.reasons.append(f"{self.answers[sock].peer}: {reason}")
        if self.current is None or sock is self.current:  # else it is not polled now
            self.poller.unregister(sock)
        if sock is self.current:
            self.current = None
            for other in self.pending:  # their answers are queued, unread: take the first one complete
                self.poller.register(other, zmq.POLLIN)

    def close(self) -> None:
        for monitor, sock in self.monitors.items():
            sock.disable_monitor()
            monitor.close(linger=0)
        for sock in self.answers:
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
