"""The streaming API: the engine steps in its own thread, each request is an
async generator of cumulative ``RequestOutput``s.

Input validation runs in the caller (bad input raises at once); adds and
aborts travel to the engine thread through a command queue, so the engine's
state is only ever touched by that thread. Outputs are cumulative, so a slow
consumer simply skips to the newest one and never falls behind.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Future
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.engine.input_processor import PromptType
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.errors import EngineDeadError
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05


class _Stream:
    """The output channel of one request, fed from the engine thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    async def next(self) -> RequestOutput:
        item = await self.queue.get()
        while not self.queue.empty() and not isinstance(item, BaseException):
            item = self.queue.get_nowait()  # cumulative outputs: only the newest matters
        if isinstance(item, BaseException):
            raise item
        return item


class AsyncLLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.config = EngineConfig(model=model, **kwargs)
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer
        self._commands: queue.SimpleQueue[tuple[str, Any, Future[Any]]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._dead: BaseException | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._thread.start()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    # -- public API -------------------------------------------------------
    async def embed(self, prompt: PromptType, pooling: str = "last", request_id: str | None = None) -> list[float]:
        """The embedding of ``prompt`` (``last`` token or ``mean`` pooling of the final hidden states)."""
        final = None
        async for output in self._stream(prompt, None, request_id, 0, pooling):
            final = output
        assert final is not None and final.embedding is not None
        return final.embedding

    def generate(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                 request_id: str | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs until the request finishes.

        Leaving the loop early (a client that disconnects) aborts the request
        and frees its KV blocks.
        """
        return self._stream(prompt, sampling_params or SamplingParams(), request_id, priority, None)

    async def _stream(self, prompt: PromptType, params: SamplingParams | None, request_id: str | None,
                      priority: int, pooling: str | None) -> AsyncIterator[RequestOutput]:
        self._check_alive()
        request_id = request_id or f"req-{next(self._ids)}"
        prepared = self.engine.prepare_request(request_id, prompt, params, priority, pooling)
        stream = _Stream(asyncio.get_running_loop())
        self._streams[request_id] = stream
        finished = False
        try:
            await self._call("add", prepared)
            while not finished:
                output = await stream.next()
                finished = output.finished
                yield output
        finally:
            self._streams.pop(request_id, None)
            if not finished and self._dead is None:
                self._commands.put(("abort", request_id, Future()))

    async def abort(self, request_id: str) -> None:
        """Abort a running request; raises ``InvalidStateTransition`` if it is finished or unknown."""
        self._check_alive()
        await self._call("abort", request_id)

    def shutdown(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=10)
        self.engine.shutdown()

    # -- engine thread ------------------------------------------------------
    async def _call(self, command: str, payload: Any) -> Any:
        future: Future[Any] = Future()
        self._commands.put((command, payload, future))
        return await asyncio.wrap_future(future)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop died: {self._dead}")

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._drain_commands(block=not self.engine.has_unfinished_requests())
                if self.engine.has_unfinished_requests():
                    self._dispatch(self.engine.step())
        except BaseException as exc:
            logger.exception("engine loop died")
            self._dead = exc
            for stream in list(self._streams.values()):
                stream.put(EngineDeadError(f"the engine loop died: {exc}"))
            self._fail_pending_commands(exc)

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._execute(*command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _execute(self, command: str, payload: Any, future: Future[Any]) -> None:
        try:
            if command == "add":
                self.engine.add_prepared(payload)
                result = None
            else:
                result = self.engine.abort_request(payload)
                self._dispatch([result] if result is not None else [])
        except Exception as exc:  # reported to the caller, the loop goes on
            future.set_exception(exc)
        else:
            future.set_result(result)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put(output)

    def _fail_pending_commands(self, exc: BaseException) -> None:
        while True:
            try:
                _, _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            future.set_exception(EngineDeadError(f"the engine loop died: {exc}"))


__all__ = ["AsyncLLM"]
