"""Admission control: bound the requests (and prompt tokens) that wait for their first token.

Running requests are already bounded by the scheduler (``max_num_seqs``, the
KV cache); without a bound on the queue in front of them, memory grows with
the offered load. A request counts as queued from admission until its first
output (or its end), so a burst between two engine steps is counted at once,
not when the engine thread gets to it. A request larger than the token bound
on its own is admitted when nothing else is queued, so it is never refused
forever.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.errors import QueueFullError


@dataclass(frozen=True)
class AdmissionLimits:
    max_queued_requests: int | None = None
    max_queued_tokens: int | None = None


class AdmissionQueue:
    """``on_reject(limit)`` is called for every refusal, where it happens: a caller that is
    cancelled meanwhile (a client that left) may never see the exception, a metric must."""

    def __init__(self, limits: AdmissionLimits, on_reject: Callable[[str], None] | None = None) -> None:
        self.limits = limits
        self.on_reject = on_reject
        self._queued: dict[str, int] = {}  # request id -> prompt tokens it will prefill
        self._tokens = 0
        self._lock = threading.Lock()  # callers may submit from several event loops

    @property
    def num_requests(self) -> int:
        return len(self._queued)

    @property
    def num_tokens(self) -> int:
        return self._tokens

    def admit(self, request_id: str, num_tokens: int) -> None:
        """Count the request as queued, or raise :class:`QueueFullError` naming the bound hit."""
        with self._lock:
            refusal = self._refusal(num_tokens)
            if refusal is None:
                self._queued[request_id] = num_tokens
                self._tokens += num_tokens
                return
        if self.on_reject is not None:
            self.on_reject(refusal.limit)
        raise refusal

    def _refusal(self, num_tokens: int) -> QueueFullError | None:
        max_requests, max_tokens = self.limits.max_queued_requests, self.limits.max_queued_tokens
        if max_requests is not None and len(self._queued) >= max_requests:
            return QueueFullError(f"too many requests are queued ({len(self._queued)}, the limit is "
                                  f"{max_requests}); retry later", limit="max_queued_requests")
        if max_tokens is not None and self._queued and self._tokens + num_tokens > max_tokens:
            return QueueFullError(f"too many prompt tokens are queued ({self._tokens} + {num_tokens}, the "
                                  f"limit is {max_tokens}); retry later", limit="max_queued_tokens")
        return None

    def release(self, request_id: str) -> None:
        """The request got its first output or ended; idempotent."""
        with self._lock:
            self._tokens -= self._queued.pop(request_id, 0)
