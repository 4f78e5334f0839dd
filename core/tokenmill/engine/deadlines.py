"""Per-request deadlines: a min-heap the engine loop polls once per iteration.

Removing an entry from the middle of a heap is O(n), so a request that ends
before its deadline is only forgotten in ``_live``; its heap entry is skipped
when it surfaces, and the heap is rebuilt once stale entries outnumber live
ones, so memory stays proportional to the requests in flight.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

_MIN_COMPACT = 64


@dataclass(frozen=True)
class Expired:
    request_id: str
    timeout_s: float


class Deadlines:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str]] = []
        self._live: dict[str, tuple[int, float]] = {}  # request id -> (entry number, timeout)
        self._numbers = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def add(self, request_id: str, now: float, timeout_s: float) -> None:
        number = next(self._numbers)  # a reused id never matches its predecessor's entry
        self._live[request_id] = (number, timeout_s)
        heapq.heappush(self._heap, (now + timeout_s, number, request_id))

    def discard(self, request_id: str) -> None:
        """The request ended on its own; its entry becomes stale."""
        if self._live.pop(request_id, None) is not None and len(self._heap) > max(_MIN_COMPACT, 2 * len(self._live)):
            self._heap = [entry for entry in self._heap if self._live.get(entry[2], (None,))[0] == entry[1]]
            heapq.heapify(self._heap)

    def pop_expired(self, now: float) -> list[Expired]:
        expired = []
        while self._heap and self._heap[0][0] <= now:
            _, number, request_id = heapq.heappop(self._heap)
            live = self._live.get(request_id)
            if live is not None and live[0] == number:
                del self._live[request_id]
                expired.append(Expired(request_id, live[1]))
        return expired
