"""Waiting queues, one per scheduling policy."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from tokenmill.request import Request


class WaitingQueue(Protocol):
    def add(self, request: Request) -> None: ...
    def add_front(self, request: Request) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove(self, request: Request) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue:
    """First come, first served; a preempted request goes back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def add_front(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    """Lowest ``priority`` value first, then earliest arrival."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = 0

    def add(self, request: Request) -> None:
        self._counter += 1
        heapq.heappush(self._heap, (request.priority, request.arrival_time, self._counter, request))

    add_front = add  # a preempted request keeps its place by priority and arrival

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[3] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap))


def preemption_key(policy: str):
    """The running request to preempt first is the max of this key."""
    if policy == "priority":
        return lambda r: (r.priority, r.arrival_time)
    return lambda r: r.arrival_time


QUEUES: dict[str, type] = {"fcfs": FCFSQueue, "priority": PriorityQueue}
