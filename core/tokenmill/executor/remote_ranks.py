"""What the executors whose ranks live in other processes share ("mp" and "ray").

Both send each call to every rank under one lock (so every rank sees the calls in one
order), collect the answers on one background thread (so ``non_block`` calls return at
once), and treat the first failed rank as fatal: they record why, stop every rank (the
others may be waiting in a collective with it) and refuse every later call with the
same :class:`WorkerFailure`.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from tokenmill.executor.base import Executor, failed


class WorkerFailure(RuntimeError):
    """A worker process died or raised; the executor is unusable afterwards."""


class RemoteRanksExecutor(Executor):
    """Failure bookkeeping and shutdown for ranks in other processes. A subclass sets
    ``_finalizer`` (a :func:`weakref.finalize` that stops every rank) before its ranks can
    fail, and calls :meth:`_start_collecting` before its first call."""

    failure: str | None = None
    _finalizer: weakref.finalize[Any, Any]
    _collector: ThreadPoolExecutor

    def _start_collecting(self, thread_name_prefix: str) -> None:
        self._collector = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name_prefix)
        self._send_lock = threading.Lock()

    def _refuse_after_failure(self, non_block: bool) -> Future[list[Any]] | None:
        """``None`` while every rank is well; after a failure, the error for this call (raised,
        or as a failed future for ``non_block``)."""
        if self.failure is None:
            return None
        error = WorkerFailure(self.failure)
        if non_block:
            return failed(error)
        raise error

    def _fail(self, message: str) -> None:
        self.failure = message
        self._finalizer()  # the other ranks may be waiting in a collective: stop them all
        raise WorkerFailure(message)

    def shutdown(self) -> None:
        if self.failure is None and self._finalizer.alive:
            with contextlib.suppress(WorkerFailure):
                self.collective_rpc("shutdown")
        self._finalizer()
        collector = getattr(self, "_collector", None)  # absent when the ranks failed to start
        if collector is not None:
            collector.shutdown(wait=False)
