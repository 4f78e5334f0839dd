"""Server-Sent Events, client disconnects, and turning cumulative outputs into deltas.

The engine yields cumulative ``RequestOutput``s. A stream sends what is new
since the last chunk, holding back the tail that a stop string could still
cut off, so that the concatenated deltas always equal the final text.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill_cli.server.state import note_disconnect

T = TypeVar("T")

DONE = "data: [DONE]\n\n"
CLIENT_CLOSED_REQUEST = 499  # nginx's code; the client is gone and never reads it


def sse_event(payload: BaseModel | str) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else payload
    return f"data: {data}\n\n"


class SSEResponse(StreamingResponse):
    """An event stream that always runs ``on_close`` when it ends, however it ends.

    Starlette cancels the body when the client disconnects, but a body that
    never started (the client left between the handler and the first byte)
    is simply dropped; ``on_close`` releases the engine requests either way.
    """

    def __init__(self, request: Request, body: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]) -> None:
        # no-cache and no proxy buffering: each event must reach the client when it is made
        super().__init__(self._tracked(body), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._request = request
        self._on_close = on_close
        self._complete = False

    async def _tracked(self, body: AsyncIterator[str]) -> AsyncIterator[str]:
        async for event in body:
            yield event
        self._complete = True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._complete:
                note_disconnect(self._request)
            await self._on_close()


# -- disconnects -----------------------------------------------------------------------
async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnected(request: Request, work: Awaitable[T]) -> T | Response:
    """Run ``work`` unless the client goes away first, in which case cancel it.

    Starlette only notices a disconnect while it streams a body; before the
    first byte (a non-streamed answer, or a stream waiting for its first
    token) cancelling here is what aborts the engine request.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server is cancelling this request: take the work with it
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    note_disconnect(request)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return Response(status_code=CLIENT_CLOSED_REQUEST)


# -- several engine requests as one stream ------------------------------------------------
async def merge_streams(streams: Sequence[AsyncIterator[T]]) -> AsyncGenerator[tuple[int, T], None]:
    """Interleave several streams of cumulative outputs as ``(index, item)``; an error in one ends all.

    Each item supersedes the one before it from the same source, so only the newest of each
    source waits for the consumer: a client that reads slowly holds one output per source,
    not one per engine step (each of which repeats the whole text so far).

    Each source runs in its own task, so closing the merged stream (or its task being
    cancelled) cancels them, and an engine generator cancelled mid-wait aborts its request.
    """
    newest: dict[int, T] = {}
    ended: set[int] = set()
    errors: list[Exception] = []
    wake = asyncio.Event()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                newest[index] = item
                wake.set()
        except Exception as exc:  # handed to the consumer, which raises it
            errors.append(exc)
        finally:
            ended.add(index)
            wake.set()

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        while newest or len(ended) < len(tasks):
            await wake.wait()
            wake.clear()
            for index in sorted(newest):
                yield index, newest.pop(index)
            if errors:
                raise errors[0]
    finally:
        for task in tasks:  # synchronous, so it happens even if this cleanup is cancelled itself
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def last_outputs(stream: AsyncIterator[tuple[int, RequestOutput]], count: int) -> list[RequestOutput]:
    """The final output of each of ``count`` merged requests."""
    final: list[RequestOutput | None] = [None] * count
    async for index, output in stream:
        final[index] = output
    return [output for output in final if output is not None]


# -- deltas ---------------------------------------------------------------------------------
@dataclass
class Delta:
    text: str
    token_start: int
    token_end: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class DeltaTracker:
    """How much of one choice's text and tokens the client has already been sent."""

    holdback: int = 0  # longest stop string - 1: a match may start that far back
    sent_chars: int = 0
    sent_tokens: int = 0
    started: bool = False  # a chunk has been sent
    finished: bool = False

    def advance(self, output: CompletionOutput) -> Delta | None:
        """What to send now for ``output`` (cumulative), or None if nothing is new."""
        if self.finished:
            return None
        finished = output.finish_reason is not None
        visible = len(output.text) if finished else max(self.sent_chars, len(output.text) - self.holdback)
        text = output.text[self.sent_chars:visible]
        if not text and not finished:
            return None  # new tokens whose text is held back ride with the next chunk
        delta = Delta(text, self.sent_tokens, len(output.token_ids), output.finish_reason, output.stop_reason)
        self.sent_chars, self.sent_tokens, self.finished = visible, len(output.token_ids), finished
        self.started = True
        return delta


def stop_holdback(stop: Sequence[str] | None) -> int:
    return max((len(s) for s in stop or ()), default=1) - 1
