"""The multi-process executor ("mp"): one worker process per rank (tensor-parallel ranks
times pipeline stages).

Each rank is a process started with multiprocessing's "spawn" context (a fresh
interpreter: no forked torch state or threads). It joins the ``torch.distributed``
group over TCP on 127.0.0.1 with the platform's backend (gloo on the CPU), builds its
:class:`~tokenmill.worker.worker.Worker` from ``spec.for_rank(rank)`` (the same plugins,
by name; its own checkpoint, its slice of every weight) and then answers
``(method, args, kwargs)`` messages from a pipe with ``worker.execute_method``, one
at a time, in order. The engine's process holds no model.

Failure, not hangs: the parent waits on each pipe in short polls and checks between
them that every rank is alive, so a rank that dies (or raises: the others may then
wait forever in a collective) makes the call raise :class:`WorkerFailure` naming it,
and every rank is torn down. No rank outlives the engine: they are daemon processes
(terminated when the parent exits), the executor's finalizer terminates them, and a
rank whose engine vanished (a SIGKILLed engine) sees its pipe close and exits.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import socket
import time
import traceback
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from tokenmill.executor.cpu_binding import bind_to_cores, plan_binding
from tokenmill.executor.remote_ranks import RemoteRanksExecutor
from tokenmill.executor.remote_ranks import WorkerFailure as WorkerFailure  # where callers first found it
from tokenmill.platform import Platform, platform_device_count
from tokenmill.worker.spec import WorkerSpec

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.1  # how often a waiting call checks that every rank is alive
DEATH_GRACE_SECONDS = 1.0  # how long a rank's error waits for a peer to show as dead (the cause)
STOP_SECONDS = 5.0  # how long a rank may take to exit on shutdown before it is killed


class MultiprocExecutor(RemoteRanksExecutor):
    """``spec.config.world_size`` worker processes (``spec.world_size`` is set to it)."""

    def __init__(self, spec: WorkerSpec, platform: Platform | None = None, **worker_args: Any) -> None:
        world_size = spec.config.world_size
        super().__init__(spec)
        devices = platform_device_count(platform) if platform is not None else None
        if devices is not None and devices < world_size:
            raise ValueError(f"tensor_parallel_size={spec.config.tensor_parallel_size} x pipeline_parallel_size="
                             f"{spec.config.pipeline_parallel_size} needs a device per rank; the "
                             f"{getattr(platform, 'name', 'platform')} platform has {devices}")
        backend = platform.dist_backend if platform is not None else "gloo"
        threads = rank_threads(spec, world_size)
        cores: list[frozenset[int] | None] = [None] * world_size
        if getattr(platform, "device_type", "cpu") == "cpu":  # each rank on its own cores (executor.cpu_binding)
            cores, threads = plan_binding(world_size, threads)
        config = spec.config.model_copy(update={"num_threads": threads})
        port = free_port()
        context = multiprocessing.get_context("spawn")
        self.processes: list[BaseProcess] = []
        self.pipes: list[Connection] = []
        for rank in range(world_size):
            rank_spec = WorkerSpec(spec.model_path, config, spec.dtype, spec.max_model_len, spec.plugins,
                                   world_size=world_size).for_rank(rank)
            parent_end, child_end = context.Pipe()
            process = context.Process(target=run_worker, args=(rank_spec, backend, port, child_end, cores[rank]),
                                      name=f"tokenmill-worker-{rank}", daemon=True)
            process.start()
            child_end.close()
            self.processes.append(process)
            self.pipes.append(parent_end)
        self._finalizer = weakref.finalize(self, stop_processes, list(self.processes), list(self.pipes))
        self._start_collecting("tokenmill-mp-collect")
        logger.info("mp executor: %d ranks over %s, %d threads each, cores %s", world_size, backend, threads,
                    [sorted(c) if c is not None else "unpinned" for c in cores])
        try:
            self._gather()  # every rank reports once its model is built
        except BaseException:
            self._finalizer()
            raise

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple[Any, ...] = (),
                       kwargs: dict[str, Any] | None = None, non_block: bool = False,
                       ) -> Any:  # list[Any] | Future[list[Any]], as the overloads say
        refused = self._refuse_after_failure(non_block)
        if refused is not None:
            return refused
        with self._send_lock:  # the calls reach every rank in one order
            for rank, pipe in enumerate(self.pipes):
                try:
                    pipe.send((method, args, kwargs))
                except OSError as exc:  # a rank that died: its end of the pipe is gone
                    lost = self._collector.submit(self._lost, rank, exc)
                    return lost if non_block else lost.result()
            future: Future[list[Any]] = self._collector.submit(self._gather)
        return future if non_block else future.result()

    def _gather(self) -> list[Any]:
        """Every rank's answer to the oldest outstanding call, in rank order."""
        results = []
        for rank, pipe in enumerate(self.pipes):
            try:
                while not pipe.poll(POLL_SECONDS):
                    self._check_alive()
                status, value = pipe.recv()
            except (EOFError, OSError):  # a rank that died closes its pipe a moment before it can be reaped
                self._check_alive(grace=DEATH_GRACE_SECONDS)
                self._fail(f"worker rank {rank} closed its pipe")
            if status == "error":
                # A rank that died explains the others' failed collectives best; its peers see
                # its sockets close a moment before it can be reaped, so give it that moment. A rank
                # that exited cleanly did so after sending its own error (one raised while it was
                # built): that is no death to report.
                self._check_alive(grace=DEATH_GRACE_SECONDS, clean_exits_reported=True)
                self._fail(f"worker rank {rank} raised:\n{value}")
            results.append(value)
        return results

    def _lost(self, rank: int, exc: OSError) -> list[Any]:
        """Fail for a rank whose pipe broke: by its death where it shows, else by the pipe."""
        self._check_alive(grace=DEATH_GRACE_SECONDS)
        self._fail(f"worker rank {rank}'s pipe broke: {exc}")
        return []  # unreachable: _fail raises

    def _check_alive(self, grace: float = 0.0, clean_exits_reported: bool = False) -> None:
        """Fail naming the first rank that is dead, waiting up to ``grace`` seconds for one to be.
        A rank that exited with 0 and whose pipe still holds a message (the error it sent before
        returning) is left for that message to explain; with ``clean_exits_reported``, any rank that
        exited with 0 is (its message was read)."""
        deadline = time.monotonic() + grace
        while True:
            for rank, process in enumerate(self.processes):
                if process.is_alive() or (clean_exits_reported and process.exitcode == 0):
                    continue
                with contextlib.suppress(OSError):
                    if process.exitcode == 0 and self.pipes[rank].poll(0):
                        continue
                self._fail(f"worker rank {rank} (pid {process.pid}) died with exit code {process.exitcode}")
            if time.monotonic() >= deadline:
                return
            time.sleep(POLL_SECONDS / 10)


def rank_threads(spec: WorkerSpec, world_size: int) -> int:
    """Each rank's share of the threads the engine's platform chose for this process
    (``num_threads``, else what it set torch to: the usable cores, or TOKENMILL_NUM_THREADS)."""
    return max(1, (spec.config.num_threads or torch.get_num_threads()) // world_size)


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on now, for rank 0's rendezvous store."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def stop_processes(processes: list[BaseProcess], pipes: list[Connection]) -> None:
    """Ask every rank to exit, then terminate (and kill) those that have not."""
    for pipe in pipes:
        with contextlib.suppress(OSError, ValueError):
            pipe.send(None)
    for process in processes:
        process.join(STOP_SECONDS if process.is_alive() else 0)
        if process.is_alive():
            process.terminate()
            process.join(STOP_SECONDS)
        if process.is_alive():
            process.kill()
            process.join()
    for pipe in pipes:
        pipe.close()


def run_worker(spec: WorkerSpec, backend: str, port: int, pipe: Connection,
               cores: frozenset[int] | None = None) -> None:
    """A worker process: pin it to its ``cores`` (None: unpinned), join the group, build the
    worker (its platform sets the thread count then), answer calls until told to stop."""
    import os

    import torch.distributed as dist

    from tokenmill.worker.worker import Worker

    # torchrun's convention: what a platform with a device per rank picks its device by
    os.environ.update(RANK=str(spec.rank), LOCAL_RANK=str(spec.local_rank), WORLD_SIZE=str(spec.world_size))
    try:
        bind_to_cores(cores)  # before any thread pool starts: they inherit the affinity
        dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{port}", rank=spec.rank,
                                world_size=spec.world_size)
        worker = Worker(spec)
    except BaseException:
        pipe.send(("error", traceback.format_exc()))
        return
    pipe.send(("ok", None))
    while True:
        try:
            message = pipe.recv()
        except EOFError:  # the engine is gone
            break
        if message is None:
            break
        method, args, kwargs = message
        try:
            reply = ("ok", worker.execute_method(method, args, kwargs))
        except BaseException:
            reply = ("error", traceback.format_exc())
        pipe.send(reply)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
