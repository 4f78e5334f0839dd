"""The server's own lifecycle: admitting, then draining, then stopped.

A drain (SIGTERM) stops admission at once (new inference requests get a 503,
``/ready`` turns 503 so a load balancer stops sending), lets the running
requests finish for up to ``shutdown_timeout`` seconds, then aborts the rest
with finish_reason ``abort`` and a message saying why, and waits a moment for
their last chunks to reach the clients. A second signal cuts the wait short.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import Request

from tokenmill_cli.server.errors import APIError
from tokenmill_cli.server.state import get_state

if TYPE_CHECKING:
    from tokenmill.entrypoints.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

SHUTDOWN_MESSAGE = "the server is shutting down: the request was aborted before it finished"
_POLL_S = 0.05
_FLUSH_S = 5.0  # after the aborts: time for the last chunks to be written


@dataclass
class Lifecycle:
    draining: bool = False
    _hurry: asyncio.Event = field(default_factory=asyncio.Event)

    def hurry(self) -> None:
        """Stop waiting for running requests: abort them now (a second signal)."""
        self._hurry.set()

    async def drain(self, engine: AsyncLLM, timeout_s: float) -> None:
        self.draining = True
        logger.info("draining: admission stopped; waiting up to %.0f s for %d running request(s)", timeout_s,
                    engine.num_requests)
        finished_in_time = await self._wait_idle(engine, timeout_s)
        if not finished_in_time and engine.is_running:
            aborted = await engine.abort_all(SHUTDOWN_MESSAGE)
            logger.warning("shutdown timeout: aborted %d request(s) still running", aborted)
            await self._wait_idle(engine, _FLUSH_S, hurry=False)
        logger.info("drained")

    async def _wait_idle(self, engine: AsyncLLM, timeout_s: float, hurry: bool = True) -> bool:
        deadline = time.monotonic() + timeout_s
        while engine.num_requests and engine.is_running:
            if time.monotonic() >= deadline or (hurry and self._hurry.is_set()):
                return False
            await asyncio.sleep(_POLL_S)
        return True


def check_admitting(request: Request) -> None:
    """A dependency of every route that starts engine work: refused while draining."""
    state = get_state(request)
    if state.lifecycle.draining:
        state.metrics.reject("shutting_down")
        raise APIError(503, "the server is shutting down and admits no new requests", code="server_shutting_down")
