"""The API side of an engine in its own process (``AsyncLLM(engine_process=True)``).

``EngineProcessClient`` starts :func:`~tokenmill.entrypoints.engine_process.run_engine_process`
in a spawned process and stands where ``LLMEngine`` stands in the in-thread mode: it answers
what the front end reads (the tokenizer, ``model_info``, the scheduler's figures as of the last
step) and prepares requests here, with the same input processor the engine would build (from the
checkpoint's folder: tokenizer, processor, structured-output checks; no weights), so a bad
request fails in the caller and only validated ones cross over.

Commands go out on a ZeroMQ PUSH socket from whichever thread calls (one lock; a send never
waits for the engine, ZeroMQ queues it); a receiver thread here reads the engine's messages and
hands outputs to ``dispatch``, replies to their futures and statistics to the stat loggers. That
thread holds the GIL only to unpickle a message: the step runs in the other process.

If the process dies (it raised, or was killed), every waiting call fails and ``die`` is told
at once: no request hangs on a process that is gone.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import multiprocessing
import pickle
import shutil
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
import zmq

from tokenmill.config import EngineConfig
from tokenmill.engine.input_processor import PromptType
from tokenmill.engine.llm_engine import PreparedRequest, build_input_processor, prepare_request
from tokenmill.engine.model_info import ModelInfo
from tokenmill.entrypoints.engine_process import EngineState, rebuild_exception, run_engine_process
from tokenmill.errors import EngineDeadError
from tokenmill.lora.request import LoRARequest
from tokenmill.metrics.stats import SchedulerSnapshot, StatLogger
from tokenmill.model_loader.loader import load_checkpoint
from tokenmill.outputs import RequestOutput
from tokenmill.platform import detect_platform
from tokenmill.plugins.manager import get_plugin_manager
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

_POLL_MS = 100  # how soon a dead process is noticed while it sends nothing
_STOP_TIMEOUT_S = 10.0


class EngineProcessDied(RuntimeError):
    """The engine process exited, or its loop raised (the message says which)."""


class EngineProcessClient:
    """``dispatch(outputs)`` and ``beat()`` are called on the receiver thread for every message;
    ``die(exc)`` once, when the process is gone."""

    def __init__(self, config: EngineConfig, dispatch: Callable[[list[RequestOutput]], None],
                 beat: Callable[[], None], die: Callable[[BaseException], None]) -> None:
        self.config = config
        self.stat_loggers: list[StatLogger] = []
        self._dispatch, self._beat, self._die = dispatch, beat, die
        self._folder = tempfile.mkdtemp(prefix="tokenmill-engine-")
        self._context = zmq.Context()
        self._commands = self._context.socket(zmq.PUSH)
        self._commands.setsockopt(zmq.LINGER, 0)
        self._commands.setsockopt(zmq.SNDHWM, 0)  # no bound: a burst of adds during a long step never blocks a sender
        self._commands.bind(f"ipc://{self._folder}/commands")
        self._outputs = self._context.socket(zmq.PULL)
        self._outputs.bind(f"ipc://{self._folder}/outputs")
        self._send_lock = threading.Lock()  # a ZeroMQ socket is not thread-safe
        self._calls: dict[int, Future[Any]] = {}
        self._call_ids = itertools.count()
        self._loras: dict[str, LoRARequest] = {}
        self._failed_loggers: set[int] = set()
        self._dead: BaseException | None = None
        self._stopping = False
        # not a daemon: a daemonic process may not start the engine's own children (TP workers)
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_process, args=(config, f"ipc://{self._folder}/commands",
                                             f"ipc://{self._folder}/outputs"),
            name="tokenmill-engine-core")
        self.process.start()
        try:
            self.model_info, self.state = self._wait_ready()
            self._build_front_end()
        except BaseException:
            self.process.kill()
            self.process.join()
            self._close()
            raise
        # multiprocessing joins a non-daemonic child at exit: stop it first, or exit would wait forever
        atexit.register(self.shutdown)
        self.receiver = threading.Thread(target=self._receive, name="tokenmill-engine-client", daemon=True)
        self.receiver.start()

    # -- what the front end reads (LLMEngine's names) -------------------------
    @property
    def max_model_len(self) -> int:
        return self.model_info.max_model_len

    @property
    def scheduler_stats(self) -> SchedulerSnapshot:
        return self.state.scheduler

    @property
    def num_unfinished_requests(self) -> int:
        return self.state.num_unfinished

    @property
    def num_deadlines(self) -> int:
        return self.state.num_deadlines

    def prepare_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None,
                        priority: int = 0, pooling: str | None = None, truncate_prompt_tokens: int | None = None,
                        lora_request: LoRARequest | None = None) -> PreparedRequest:
        return prepare_request(self.input_processor, self.model_info, request_id, prompt, params, priority,
                               pooling, truncate_prompt_tokens, lora_request)

    def list_loras(self) -> list[LoRARequest]:
        return list(self._loras.values())

    # -- commands ---------------------------------------------------------------
    def call(self, command: str, payload: Any) -> Future[Any]:
        """Send ``command``; the future holds the engine's answer (or its exception)."""
        future: Future[Any] = Future()
        if self._dead is not None:
            future.set_exception(_dead_error(self._dead))
            return future
        call_id = next(self._call_ids)
        self._calls[call_id] = future
        if command in ("add_lora", "remove_lora"):
            future.add_done_callback(lambda done: self._track_lora(command, payload, done))
        with self._send_lock:
            self._commands.send(pickle.dumps((call_id, command, payload)))
        if self._dead is not None:  # it died between the check and the send: nobody will answer
            self._fail_calls(self._dead)
        return future

    def forward_stats(self, stat_logger: StatLogger) -> None:
        """Run ``stat_logger`` here on what the engine records (it starts recording with the first)."""
        self.stat_loggers.append(stat_logger)
        self.call("forward_stats", None)

    def forward_expert_loads(self, stat_logger: StatLogger, interval_s: float) -> None:
        """Have the engine read its MoE counters (``ExpertLoadReads``) and send them with its stats,
        for ``stat_logger`` (an ``ExpertLoadStatLogger(None, ...)``) to take them from there."""
        self.stat_loggers.append(stat_logger)
        self.call("forward_expert_loads", interval_s)

    def shutdown(self) -> None:
        """Stop the loop and the process (killed if it does not stop in time); idempotent."""
        if self._stopping:
            return
        self._stopping = True
        atexit.unregister(self.shutdown)
        if self.process.is_alive() and self._dead is None:
            self.call("stop", None)
            self.process.join(_STOP_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.receiver.join()  # it sees the process gone within one poll, and ends
        self._close()

    # -- receiver thread --------------------------------------------------------
    def _wait_ready(self) -> tuple[ModelInfo, EngineState]:
        while not self._outputs.poll(_POLL_MS):
            if not self.process.is_alive():
                raise EngineProcessDied(f"the engine process exited with code {self.process.exitcode} "
                                        "while it was starting")
        kind, *values = pickle.loads(self._outputs.recv())
        if kind == "failed":
            raise rebuild_exception(values[0])
        return values[0], values[1]

    def _build_front_end(self) -> None:
        """The input processor, from the folder the engine loaded (already resolved: no hub lookup)."""
        plugins = get_plugin_manager(strict=self.config.strict_plugins)
        info = self.model_info
        checkpoint = load_checkpoint(info.path, plugins, detect_platform(plugins), getattr(torch, info.dtype),
                                     tokenizer=self.config.tokenizer)
        self.tokenizer = checkpoint.tokenizer
        # Validation at admission needs the backend here: a bad schema, regex or grammar is a 400
        # from this process, before the request crosses over. The backend is built lazily, once, on
        # the first constrained request, and only parses (tokenizer-free); the costly part, the
        # compiler's token tables, is built only where grammars compile: in the engine's process.
        self.structured = StructuredOutputManager.from_plugins(plugins, self.config.structured_outputs_backend,
                                                          checkpoint.tokenizer, info.vocab_size, info.stop_token_ids)
        self.input_processor = build_input_processor(checkpoint, info, plugins, self.config,
                                                     self.structured.validate)

    def _receive(self) -> None:
        try:
            while self._dead is None:
                if self._outputs.poll(_POLL_MS):
                    self._handle(pickle.loads(self._outputs.recv()))
                elif not self.process.is_alive():
                    self._mark_dead(RuntimeError("the engine was shut down") if self._stopping else EngineProcessDied(
                        f"the engine process exited with code {self.process.exitcode}"))
        except BaseException as exc:
            logger.exception("the engine client's receiver failed")
            self._mark_dead(exc)
        self.process.join(_STOP_TIMEOUT_S)  # reap it: a process that reported its death exits next

    def _handle(self, message: tuple[Any, ...]) -> None:
        self._beat()
        kind = message[0]
        if kind == "outputs":
            _, outputs, state, records = message
            self.state = state
            self._record(records)
            if outputs:
                self._dispatch(outputs)
        elif kind == "reply":
            _, call_id, ok, value = message
            future = self._calls.pop(call_id, None)
            if future is not None and future.set_running_or_notify_cancel():
                future.set_result(value) if ok else future.set_exception(rebuild_exception(value))
        elif kind == "dead":
            self._mark_dead(EngineProcessDied(f"the engine process's loop raised {message[1]}"))

    def _record(self, records: list[tuple[SchedulerSnapshot, Any]]) -> None:
        for scheduler, iteration in records:
            for stat_logger in self.stat_loggers:
                try:
                    stat_logger.record(scheduler, iteration)
                except Exception:  # metrics must never take the engine down
                    if id(stat_logger) not in self._failed_loggers:
                        self._failed_loggers.add(id(stat_logger))
                        logger.exception("stat logger %r failed (reported once)", stat_logger)

    def _mark_dead(self, exc: BaseException) -> None:
        if self._dead is None:
            self._dead = exc
            self._fail_calls(exc)
            self._die(exc)

    def _fail_calls(self, exc: BaseException) -> None:
        while self._calls:
            _, future = self._calls.popitem()
            if future.set_running_or_notify_cancel():
                future.set_exception(_dead_error(exc))

    def _track_lora(self, command: str, payload: Any, done: Future[Any]) -> None:
        if done.cancelled() or done.exception() is not None:
            return
        if command == "add_lora":
            self._loras[payload.lora_name] = payload
        else:
            self._loras.pop(payload, None)

    def _close(self) -> None:
        self._commands.close(linger=0)
        self._outputs.close(linger=0)
        self._context.term()
        shutil.rmtree(self._folder, ignore_errors=True)


def _dead_error(exc: BaseException) -> EngineDeadError:
    return EngineDeadError(f"the engine loop died: {type(exc).__name__}: {exc}")
