"""uvicorn with a drain before its shutdown, and a clean exit status.

uvicorn's own handler stops listening at the first SIGTERM/SIGINT, so a
request arriving during the drain would find the port closed instead of a
503, and it re-raises the signal once it is done, so the process would end
"killed by SIGTERM" rather than exit 0. Here the first signal starts the
drain (the port stays open and answers 503), and uvicorn's shutdown begins
only when the drain is over; a second signal cuts the drain short, a third
forces uvicorn out.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from tokenmill_cli.server.lifecycle import Lifecycle

if TYPE_CHECKING:
    from tokenmill.entrypoints.async_llm import AsyncLLM

logger = logging.getLogger(__name__)


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, engine: AsyncLLM, shutdown_timeout: float,
                 ) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task[None] | None = None
        self._signals = 0

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs as a signal handler on the loop's thread: only hand work to the loop.
        # The signal is not recorded for re-raising, so the process exits with 0.
        self._signals += 1
        if self._loop is None:  # not serving yet
            self.should_exit = True
        elif self._signals == 1:
            self._loop.call_soon_threadsafe(self._start_drain)
        elif self._signals == 2:
            logger.warning("second signal: aborting running requests now")
            self._loop.call_soon_threadsafe(self.lifecycle.hurry)
        else:
            self.should_exit = self.force_exit = True

    def _start_drain(self) -> None:
        self._drain = asyncio.create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self.lifecycle.drain(self.engine, self.shutdown_timeout)
        except Exception:  # never keep the process up because the drain went wrong
            logger.exception("drain failed")
        finally:
            self.should_exit = True
