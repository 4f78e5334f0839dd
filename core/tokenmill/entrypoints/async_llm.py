"""The streaming API: the engine steps in its own thread, each request is an
async generator of cumulative ``RequestOutput``s.

Input validation and admission control run in the caller (bad input raises
at once, a full queue raises ``QueueFullError``); adds and aborts travel to
the engine thread through a command queue, so the engine's state is only
ever touched by that thread. Outputs are cumulative, so a slow consumer
simply skips to the newest one and never falls behind.

The engine thread stamps a heartbeat on every loop iteration (at least every
``_IDLE_WAIT_S`` when idle), so a health check can tell a stuck loop from a
busy one. If the loop dies, every open stream and every later call raises
``EngineDeadError`` at once.

With ``engine_process=True`` the engine steps in a process of its own instead
(:mod:`tokenmill.entrypoints.engine_client`): the same interface, with the commands
sent over ZeroMQ and a receiver thread here in place of the engine thread.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from typing import Any, cast

from prometheus_client import CollectorRegistry

from tokenmill.config import EngineConfig
from tokenmill.engine.input_processor import PromptType
from tokenmill.engine.llm_engine import LLMEngine, PreparedRequest
from tokenmill.engine.model_info import ModelInfo
from tokenmill.entrypoints.admission import AdmissionLimits, AdmissionQueue
from tokenmill.entrypoints.engine_client import EngineProcessClient
from tokenmill.entrypoints.scoring import check_classifier
from tokenmill.errors import EngineDeadError, InvalidRequestError
from tokenmill.lora.request import LoRARequest
from tokenmill.metrics.expert_load import ExpertLoadStatLogger, engine_expert_loads, engine_expert_replicas
from tokenmill.metrics.stats import SchedulerSnapshot, StatLogger
from tokenmill.outputs import RequestOutput
from tokenmill.pooling import finish_embedding
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05


class _Stream:
    """The output channel of one request, fed from the engine thread.

    Outputs are cumulative, so only the newest is kept: a consumer that falls
    behind skips to it, and a slow one holds one output, not one per step. An
    error, or the final output, is never replaced by what comes after it.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._item: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self._offer, item)

    def _offer(self, item: RequestOutput | BaseException) -> None:
        held = self._item
        if isinstance(held, BaseException) or (held is not None and held.finished):
            return
        self._item = item
        self._ready.set()

    async def next(self) -> RequestOutput:
        await self._ready.wait()
        item, self._item = self._item, None
        self._ready.clear()
        if isinstance(item, BaseException):
            raise item
        assert item is not None
        return item


class AsyncLLM:
    """``AsyncLLM(model, **EngineConfig fields)``.

    ``stat_loggers`` receive the engine's statistics after every step (in the
    engine thread); ``max_queued_requests`` / ``max_queued_tokens`` bound the
    requests waiting for their first token (see :mod:`tokenmill.entrypoints.admission`).
    The engine is built, and stepped, on its own thread (see ``_run``), or with
    ``engine_process=True`` in its own process (its stat loggers then run on the thread here
    that receives its outputs).
    """

    engine: LLMEngine | EngineProcessClient

    def __init__(self, model: str | None = None, *, stat_loggers: Sequence[StatLogger] | None = None,
                 max_queued_requests: int | None = None, max_queued_tokens: int | None = None,
                 **kwargs: Any) -> None:
        self.config = EngineConfig(model=model, **kwargs)
        self.admission = AdmissionQueue(AdmissionLimits(max_queued_requests, max_queued_tokens))
        self._commands: queue.SimpleQueue[tuple[str, Any, Future[Any]]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._dead: BaseException | None = None
        self._heartbeat = time.monotonic()
        self._stopping = threading.Event()
        self._handlers: dict[str, Callable[[Any], Any]] = {
            "add": self._add, "abort": self._abort, "abort_all": self._abort_all,
            "stat_logger": lambda stat_logger: self.engine.stat_loggers.append(stat_logger),
            "add_lora": lambda payload: self._local.add_lora(*payload),
            "remove_lora": lambda name: self._local.remove_lora(name),
        }
        if self.config.engine_process:
            self._start_process(list(stat_loggers or []))
            return
        built: Future[None] = Future()
        self._thread = threading.Thread(target=self._run, args=(built, list(stat_loggers or [])),
                                        name="tokenmill-engine", daemon=True)
        self._thread.start()
        built.result()  # the engine thread has set self.engine; raises what building it raised
        self.tokenizer = self.engine.tokenizer

    def _start_process(self, stat_loggers: list[StatLogger]) -> None:
        def beat() -> None:
            self._heartbeat = time.monotonic()

        client = EngineProcessClient(self.config, self._dispatch, beat, self._die)
        self.engine, self._thread = client, client.receiver
        for stat_logger in stat_loggers:
            client.forward_stats(stat_logger)
        self.tokenizer = client.tokenizer

    @property
    def _local(self) -> LLMEngine:
        """The engine this process steps (the in-thread mode's), for the engine thread's handlers."""
        assert isinstance(self.engine, LLMEngine)
        return self.engine

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_info(self) -> ModelInfo:
        return self.engine.model_info

    def scheduler_stats(self) -> SchedulerSnapshot:
        """The scheduler's snapshot as of the engine's last step: safe to read from any thread."""
        return self.engine.scheduler_stats

    @property
    def num_unfinished_requests(self) -> int:
        """Requests the engine is still working on (read without locking)."""
        return self.engine.num_unfinished_requests

    @property
    def num_deadlines(self) -> int:
        return self.engine.num_deadlines

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    @property
    def dead_reason(self) -> str | None:
        """Why the engine loop stopped (its exception), or None while it runs."""
        return None if self._dead is None else _describe(self._dead)

    @property
    def num_requests(self) -> int:
        """Requests in flight: submitted and not yet ended (their streams are open)."""
        return len(self._streams)

    def seconds_since_heartbeat(self) -> float:
        """Time since the engine loop last went round; large while a step hangs."""
        return time.monotonic() - self._heartbeat

    # -- public API -------------------------------------------------------
    async def embed(self, prompt: PromptType, pooling: str = "auto", request_id: str | None = None,
                    truncate_prompt_tokens: int | None = None, dimensions: int | None = None) -> list[float]:
        """The embedding of ``prompt`` (``last`` token, ``cls`` (first) or ``mean`` pooling of the final
        hidden states; ``auto``: the model's), normalised where the model's sentence-transformers
        files say, truncated to ``dimensions`` for a Matryoshka model."""
        check_classifier(self.engine.model_info, False, "embeddings")
        output = await self.pool(prompt, pooling, request_id, truncate_prompt_tokens)
        return finish_embedding(cast(list[float], output.embedding), self.engine.model_info.pooler, dimensions)

    async def pool(self, prompt: PromptType, pooling: str = "auto", request_id: str | None = None,
                   truncate_prompt_tokens: int | None = None) -> RequestOutput:
        """The final output of a pooling request: its ``embedding`` is the pooled vector as the
        model computes it (a raw embedding, or a classifier's logits), its ``prompt_token_ids``
        what was pooled over (after truncation)."""
        final = None
        async for output in self._stream(prompt, None, request_id, 0, pooling, truncate_prompt_tokens=truncate_prompt_tokens):
            final = output
        if final is None or final.embedding is None:  # aborted (shutdown) or failed
            reason = final.outputs[0].finish_reason if final is not None and final.outputs else None
            raise RuntimeError(f"the embedding request ended without a result ({reason}: "
                               f"{final.error if final is not None else None})")
        return final

    def generate(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                 request_id: str | None = None, priority: int = 0,
                 timeout: float | None = None, lora_request: LoRARequest | None = None,
                 ) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs until the request finishes.

        Leaving the loop early (a client that disconnects) aborts the request
        and frees its KV blocks. After ``timeout`` seconds (default: the
        config's ``request_timeout``) the request ends with finish_reason
        ``timeout``, keeping what it generated. ``lora_request``: run it with that adapter
        (loaded first, off the engine thread, if it is not yet registered).
        """
        if timeout is not None and not timeout > 0:
            raise InvalidRequestError(f"timeout must be a positive number of seconds, got {timeout}", param="timeout")
        return self._stream(prompt, sampling_params or SamplingParams(), request_id, priority, None, timeout,
                            lora_request=lora_request)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter on a thread of its own (the engine keeps stepping meanwhile),
        then register it; raises ``LoRAAdapterError``. False if it was registered already."""
        self._check_alive()
        if isinstance(self.engine, EngineProcessClient):  # the engine's process reads it
            return bool(await self._call("add_lora", lora_request))
        known = self.engine.lora.adapters.get(lora_request.lora_name)
        if known is not None and known.lora_path == lora_request.lora_path:
            return False
        adapter = await asyncio.to_thread(self.engine.lora.load_now, lora_request)
        return bool(await self._call("add_lora", (lora_request, adapter)))

    async def remove_lora(self, lora_name: str) -> None:
        """Unregister an adapter: requests that use it finish with it; later ones naming it fail."""
        self._check_alive()
        await self._call("remove_lora", lora_name)

    def list_loras(self) -> list[LoRARequest]:
        return self.engine.list_loras()

    async def _stream(self, prompt: PromptType, params: SamplingParams | None, request_id: str | None,
                      priority: int, pooling: str | None, timeout: float | None = None,
                      truncate_prompt_tokens: int | None = None,
                      lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        self._check_alive()
        if lora_request is not None:
            await self.add_lora(lora_request)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._streams:  # its outputs would go to the other stream
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        prepare = functools.partial(self.engine.prepare_request, request_id, prompt, params, priority, pooling,
                                    truncate_prompt_tokens, lora_request)
        # images go through the model's processor (resize, normalise): on a worker thread, so a big one
        # does not hold up the event loop that streams every other request's tokens
        has_media = not isinstance(prompt, str) and bool(prompt.get("multi_modal_data"))
        prepared = await asyncio.to_thread(prepare) if has_media else prepare()
        self.admission.admit(request_id, len(prepared.prompt.token_ids) * len(prepared.requests))
        stream = _Stream(asyncio.get_running_loop())
        self._streams[request_id] = stream
        finished = False
        try:
            await self._call("add", (prepared, timeout))
            while not finished:
                output = await stream.next()
                self.admission.release(request_id)  # it has started: no longer waiting in the queue
                finished = output.finished
                yield output
        finally:
            self.admission.release(request_id)
            self._streams.pop(request_id, None)
            if not finished and self._dead is None:
                self._send("abort", (request_id, None))

    async def abort(self, request_id: str, message: str | None = None) -> None:
        """Abort a running request (finish_reason ``abort``, ``message`` as its error);
        raises ``InvalidStateTransition`` if it is finished or unknown."""
        self._check_alive()
        await self._call("abort", (request_id, message))

    async def abort_all(self, message: str | None = None) -> int:
        """Abort every unfinished request (server shutdown); returns how many were aborted."""
        self._check_alive()
        return await self._call("abort_all", message)

    def add_stat_logger(self, stat_logger: StatLogger, timeout: float = 10.0) -> None:
        """Attach a stat logger to the running engine (from any thread but the engine's)."""
        self._check_alive()
        if isinstance(self.engine, EngineProcessClient):
            self.engine.forward_stats(stat_logger)
            return
        future: Future[Any] = Future()
        self._commands.put(("stat_logger", stat_logger, future))
        future.result(timeout)

    def add_expert_load_logger(self, model_name: str, registry: CollectorRegistry, interval_s: float = 10.0) -> None:
        """The Prometheus series of a MoE model's expert load (``ExpertLoadStatLogger``). The counters
        are read where the engine steps: on its thread, or in its process, which sends them with its
        stats; a model without experts stops the reads at once."""
        self._check_alive()
        if isinstance(self.engine, EngineProcessClient):
            self.engine.forward_expert_loads(ExpertLoadStatLogger(None, model_name, registry), interval_s)
            return
        local = self._local
        self.add_stat_logger(ExpertLoadStatLogger(lambda: engine_expert_loads(local), model_name, registry, interval_s,
                                                  read_replicas=lambda: engine_expert_replicas(local)))

    def shutdown(self) -> None:
        if isinstance(self.engine, EngineProcessClient):
            self.engine.shutdown()
            return
        self._stopping.set()
        self._thread.join(timeout=10)
        self.engine.shutdown()

    # -- engine thread ------------------------------------------------------
    async def _call(self, command: str, payload: Any) -> Any:
        return await asyncio.wrap_future(self._send(command, payload))

    def _send(self, command: str, payload: Any) -> Future[Any]:
        if isinstance(self.engine, EngineProcessClient):
            return self.engine.call(command, payload)
        future: Future[Any] = Future()
        self._commands.put((command, payload, future))
        return future

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop died: {_describe(self._dead)}")

    def _run(self, built: Future[None], stat_loggers: list[StatLogger]) -> None:
        # The engine is built on the thread that then runs every step. On the CPU, torch's
        # OpenMP runtime (libgomp) keeps a team of worker threads for each thread that starts
        # parallel work, and once there are more of them than cores it stops spinning between
        # parallel regions and sleeps instead: a model loaded on one thread and stepped on
        # another decoded 1.5-1.8x slower (docs/benchmarks.md).
        try:
            self.engine = LLMEngine(self.config, stat_loggers=stat_loggers)
        except BaseException as exc:
            built.set_exception(exc)
            return
        built.set_result(None)
        try:
            while not self._stopping.is_set():
                self._heartbeat = time.monotonic()
                self._drain_commands(block=not self.engine.has_unfinished_requests())
                if self.engine.has_unfinished_requests():
                    self._dispatch(self.engine.step())
                elif self.engine.has_pending_kv_transfers():  # idle: a step frees what was sent or outlived its lease
                    self._dispatch(self.engine.step())
        except BaseException as exc:
            logger.exception("engine loop died")
            self._die(exc)
        else:
            self._die(RuntimeError("the engine was shut down"))

    def _die(self, exc: BaseException) -> None:
        """Fail everything still waiting, at once: no caller is left hanging."""
        self._dead = exc
        error = EngineDeadError(f"the engine loop died: {_describe(exc)}")
        for stream in list(self._streams.values()):
            stream.put(error)
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
        # A caller cancelled while waiting (a client that left) cancels the future, not the
        # command: an add still happens (its abort follows), so every request is accounted for.
        # Once marked running, the future can no longer be cancelled under our feet.
        waited_for = future.set_running_or_notify_cancel()
        try:
            result = self._handlers[command](payload)
        except Exception as exc:  # reported to the caller, the loop goes on
            if waited_for:
                future.set_exception(exc)
        else:
            if waited_for:
                future.set_result(result)

    def _add(self, payload: tuple[PreparedRequest, float | None]) -> None:
        prepared, timeout = payload
        self._local.add_prepared(prepared, timeout)

    def _abort(self, payload: tuple[str, str | None]) -> None:
        request_id, message = payload
        output = self._local.abort_request(request_id, error=message)
        self._dispatch([output] if output is not None else [])

    def _abort_all(self, message: str | None) -> int:
        outputs = self._local.abort_all(message)
        self._dispatch(outputs)
        return len(outputs)

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
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineDeadError(f"the engine loop died: {_describe(exc)}"))


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


__all__ = ["AsyncLLM"]
