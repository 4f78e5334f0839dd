"""The engine's own process (``AsyncLLM(engine_process=True)``): an ``LLMEngine`` stepped in a loop,
fed and read over two ZeroMQ sockets.

The API server's process keeps the event loop, HTTP, JSON and tokenization; this one keeps the
scheduler, the model and the output processor (incremental detokenization and stop strings stay
beside the scheduler: a stop string ends its request in the step that produced it, as in the
in-thread mode, and no token crosses the boundary twice). Between steps the loop takes every
command waiting (non-blocking); idle, it waits on the command socket.

Messages are pickled tuples. Commands (API -> engine): ``(call_id, name, payload)``. Replies
(engine -> API), in order on one socket, so the outputs an abort made arrive before its reply:

* ``("ready", ModelInfo, EngineState)`` once the engine is built, or
  ``("failed", exception_record(exception))``;
* ``("outputs", [RequestOutput], EngineState, [(SchedulerSnapshot, IterationStats)])`` after a
  step that produced something, and at least every ``HEARTBEAT_S`` (the API side's heartbeat);
* ``("reply", call_id, ok, result or exception_record(exception))`` for every command (an
  ``add_lora``'s once its adapter was read, on a side thread: the loop keeps stepping meanwhile);
* ``("dead", description)`` when the loop raised: the process then exits.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from tokenmill.config import EngineConfig
from tokenmill.lora.request import LoRARequest
from tokenmill.metrics.expert_load import ExpertLoadReads, engine_expert_loads, engine_expert_replicas
from tokenmill.metrics.stats import IterationStats, SchedulerSnapshot
from tokenmill.outputs import RequestOutput

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.25  # the longest the API side goes without a message from a live loop
_IDLE_POLL_MS = 50


@dataclass(frozen=True)
class EngineState:
    """The figures the API side reads without asking (health, /engine/stats), as of the last step."""

    scheduler: SchedulerSnapshot
    num_unfinished: int
    num_deadlines: int


class _ForwardingStatLogger:
    """Keeps what the engine records, to ship with the next outputs: the API side's loggers
    (Prometheus, the log line) run there, where /metrics is served."""

    def __init__(self) -> None:
        self.records: list[tuple[SchedulerSnapshot, IterationStats]] = []
        self.expert_loads: ExpertLoadReads | None = None  # set by "forward_expert_loads"

    def record(self, scheduler: SchedulerSnapshot, iteration: IterationStats) -> None:
        # the MoE counters live on this process's device: read them here (when it is time) and
        # send them along, for the API side's ExpertLoadStatLogger
        reads = self.expert_loads
        loads = reads.poll(scheduler) if reads is not None else None
        if reads is not None and loads is not None:
            iteration = dataclasses.replace(iteration, expert_loads=loads, expert_replicas=reads.replicas)
        self.records.append((scheduler, iteration))

    def take(self) -> list[tuple[SchedulerSnapshot, IterationStats]]:
        records, self.records = self.records, []
        return records


def run_engine_process(config: EngineConfig, command_address: str, output_address: str) -> None:
    """The process's target: build the engine, say so, step until told to stop or the API side is gone."""
    from tokenmill.engine.llm_engine import LLMEngine

    # Ctrl-C reaches the whole process group: the server drains its requests and then stops
    # this loop; SIGTERM (or a kill) still ends it at once.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    context = zmq.Context()
    commands = context.socket(zmq.PULL)
    commands.setsockopt(zmq.RCVHWM, 0)  # every command the API side sent waits here, however many
    commands.connect(command_address)
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 2000)  # the last message ("dead") still leaves after close
    outputs.connect(output_address)
    try:
        engine = LLMEngine(config)
    except BaseException as exc:
        outputs.send(pickle.dumps(("failed", exception_record(exc))))
        outputs.close()
        context.term()
        return
    loop = _EngineLoop(engine, commands, outputs)
    outputs.send(pickle.dumps(("ready", engine.model_info, loop.state())))
    try:
        loop.run()
    except BaseException as exc:
        logger.exception("engine loop died")
        outputs.send(pickle.dumps(("dead", f"{type(exc).__name__}: {exc}")))
    finally:
        engine.shutdown()
        commands.close(linger=0)
        outputs.close()
        context.term()


class _EngineLoop:
    def __init__(self, engine: Any, commands: zmq.Socket[bytes], outputs: zmq.Socket[bytes]) -> None:
        self.engine = engine
        self.commands = commands
        self.outputs = outputs
        self.stats = _ForwardingStatLogger()
        self.pending: list[RequestOutput] = []
        self.last_sent = 0.0
        self.stopping = False
        self.parent = os.getppid()
        # adapters read on side threads, waiting to be registered between steps: (call_id, request, adapter or error)
        self.loaded_loras: queue.SimpleQueue[tuple[int, LoRARequest, Any]] = queue.SimpleQueue()
        self.handlers: dict[str, Callable[[Any], Any]] = {
            "add": lambda payload: engine.add_prepared(*payload),
            "abort": self._abort, "abort_all": self._abort_all,
            "add_lora": lambda request: engine.add_lora(request),  # nothing to read: see _start_lora_load
            "remove_lora": lambda name: engine.remove_lora(name),
            "forward_stats": self._forward_stats,
            "forward_expert_loads": self._forward_expert_loads,
            "stop": self._stop,
        }

    def run(self) -> None:
        while not self.stopping:
            busy = self.engine.has_unfinished_requests() or self.engine.has_pending_kv_transfers()
            self._take_commands(wait_ms=0 if busy else _IDLE_POLL_MS)
            self._register_loaded_loras()
            if self.engine.has_unfinished_requests() or self.engine.has_pending_kv_transfers():
                self.pending.extend(self.engine.step())
            self._flush()
            if not busy and os.getppid() != self.parent:  # the API process is gone: nobody reads us
                return

    def _take_commands(self, wait_ms: int) -> None:
        if wait_ms and not self.commands.poll(wait_ms):
            return
        while not self.stopping:
            try:
                message = self.commands.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            call_id, name, payload = pickle.loads(message)
            if name == "add_lora" and self._start_lora_load(call_id, payload):
                continue  # answered once read, by _register_loaded_loras
            try:
                result, ok = self.handlers[name](payload), True
            except Exception as exc:  # the caller's to handle; the loop goes on
                result, ok = exception_record(exc), False
            self._reply(call_id, ok, result)

    def _reply(self, call_id: int, ok: bool, result: Any) -> None:
        self._flush(force=True)  # outputs an abort made go before its reply
        self.outputs.send(pickle.dumps(("reply", call_id, ok, result)))

    def _flush(self, force: bool = False) -> None:
        records = self.stats.take()
        if not (self.pending or records or force or time.monotonic() - self.last_sent > HEARTBEAT_S):
            return
        self.outputs.send(pickle.dumps(("outputs", self.pending, self.state(), records)))
        self.pending = []
        self.last_sent = time.monotonic()

    def state(self) -> EngineState:
        return EngineState(self.engine.scheduler_stats, self.engine.num_unfinished_requests,
                           self.engine.num_deadlines)

    def _abort(self, payload: tuple[str, str | None]) -> None:
        request_id, message = payload
        output = self.engine.abort_request(request_id, error=message)
        if output is not None:
            self.pending.append(output)

    def _abort_all(self, message: str | None) -> int:
        aborted = self.engine.abort_all(message)
        self.pending.extend(aborted)
        return len(aborted)

    def _forward_stats(self, _: None) -> None:
        if self.stats not in self.engine.stat_loggers:
            self.engine.stat_loggers.append(self.stats)

    def _forward_expert_loads(self, interval_s: float) -> None:
        self._forward_stats(None)
        self.stats.expert_loads = ExpertLoadReads(lambda: engine_expert_loads(self.engine), interval_s,
                                                  lambda: engine_expert_replicas(self.engine))

    # -- LoRA adapters: read off the step loop, as AsyncLLM's in-thread mode does ------
    def _start_lora_load(self, call_id: int, request: LoRARequest) -> bool:
        """Read ``request``'s adapter on a thread of its own (a large one, or one fetched from the
        Hub, takes seconds; the loop keeps stepping); False if there is nothing to read (it is
        registered already, or LoRA is off: the handler answers at once)."""
        if self.engine.core.lora is None:
            return False
        known = self.engine.lora.adapters.get(request.lora_name)
        if known is not None and known.lora_path == request.lora_path:
            return False
        threading.Thread(target=self._read_lora, args=(call_id, request), name="tokenmill-lora-load",
                         daemon=True).start()
        return True

    def _read_lora(self, call_id: int, request: LoRARequest) -> None:
        try:
            adapter: Any = self.engine.lora.load_now(request)
        except Exception as exc:
            adapter = exc
        self.loaded_loras.put((call_id, request, adapter))

    def _register_loaded_loras(self) -> None:
        while True:
            try:
                call_id, request, adapter = self.loaded_loras.get_nowait()
            except queue.Empty:
                return
            try:
                if isinstance(adapter, Exception):
                    raise adapter
                result, ok = self.engine.add_lora(request, adapter), True
            except Exception as exc:
                result, ok = exception_record(exc), False
            self._reply(call_id, ok, result)

    def _stop(self, _: None) -> None:
        self.stopping = True


ExceptionRecord = tuple[type[BaseException], tuple[Any, ...], dict[str, Any]]


def exception_record(exc: BaseException) -> ExceptionRecord:
    """What rebuilds ``exc`` in the other process without calling its ``__init__`` (ours take
    other arguments than their message): its class, ``args`` and attributes. One that does not
    pickle becomes a RuntimeError that describes it."""
    record: ExceptionRecord = (type(exc), exc.args, dict(vars(exc)))
    try:
        pickle.dumps(record)
    except Exception:
        return RuntimeError, (f"{type(exc).__name__}: {exc}",), {}
    return record


def rebuild_exception(record: ExceptionRecord) -> BaseException:
    cls, args, state = record
    exc = cls.__new__(cls)
    exc.args = args
    exc.__dict__.update(state)
    return exc
