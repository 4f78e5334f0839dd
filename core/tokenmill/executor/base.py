"""The executor seam: where the model runs (this process, TP worker
processes, Ray actors). The engine core only speaks this interface.

An executor has one primitive, :meth:`Executor.collective_rpc`: run a
:class:`~tokenmill.worker.worker.Worker` method (by name) or a function (given
the worker) on every worker, and return the results in rank order. Everything
else the core asks is written on top of it, so an executor for worker
processes implements one method and the way it starts its workers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Literal, TypeVar, overload

from tokenmill.kv_transfer.aggregate import KVOutputAggregator
from tokenmill.scheduler.output import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from tokenmill.worker.spec import WorkerSpec

T = TypeVar("T")


class Executor(ABC):
    """Built with the rank-0 :class:`WorkerSpec`; ``spec.world_size`` says how many ranks to start.

    ``worker_args`` are in-process extras an executor may pass to a worker in the engine's
    own process (the engine's ``plugins``, ``platform`` and loaded ``checkpoint``, ``progress``
    for a progress bar); an executor whose workers live elsewhere ignores them, and each
    worker rebuilds them from the spec.
    """

    def __init__(self, spec: WorkerSpec, **worker_args: Any) -> None:
        self.spec = spec

    @overload
    def collective_rpc(self, method: str | Callable[..., Any], args: tuple[Any, ...] = (),
                       kwargs: dict[str, Any] | None = None, non_block: Literal[False] = False) -> list[Any]: ...

    @overload
    def collective_rpc(self, method: str | Callable[..., Any], args: tuple[Any, ...] = (),
                       kwargs: dict[str, Any] | None = None, *, non_block: Literal[True]) -> Future[list[Any]]: ...

    @abstractmethod
    def collective_rpc(self, method: str | Callable[..., Any], args: tuple[Any, ...] = (),
                       kwargs: dict[str, Any] | None = None, non_block: bool = False,
                       ) -> list[Any] | Future[list[Any]]:
        """Run ``method`` on every worker; its results, one per rank in rank order.

        A string names a public :class:`~tokenmill.worker.worker.Worker` method, called as
        ``worker.method(*args, **kwargs)``; a callable is called as ``method(worker, *args,
        **kwargs)`` on the worker (for a worker in another process it must pickle: a
        module-level function). ``non_block``: return a ``Future`` of the list at once.
        """

    def kv_bytes_per_block(self) -> int:
        """KV bytes one block takes across all layers, on the worker that holds the most (every
        rank holds the same number of blocks; pipeline stages may hold different layer counts)."""
        return max(int(n) for n in self.collective_rpc("kv_bytes_per_block"))

    def kv_cache_budget(self) -> int:
        """Bytes the KV cache may use: the least any worker's platform measured after loading,
        since every rank holds the same number of blocks."""
        return min(self.collective_rpc("kv_cache_budget"))

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("allocate_kv_cache", (num_blocks,))

    @overload
    def execute_model(self, scheduler_output: SchedulerOutput, non_block: Literal[False] = False) -> None: ...

    @overload
    def execute_model(self, scheduler_output: SchedulerOutput, non_block: Literal[True]) -> Future[list[None]]: ...

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False,
                      ) -> Future[list[None]] | None:
        """Run one step's forward on every worker; :meth:`sample_tokens` then gives its output.

        ``non_block``: return at once, with a future that completes when every forward has (the
        engine core builds the step's grammar bitmask meanwhile). An executor that runs the
        forward in place returns it completed.
        """
        if non_block:
            return self.collective_rpc("execute_model", (scheduler_output,), non_block=True)
        self.collective_rpc("execute_model", (scheduler_output,))
        return None

    @overload
    def sample_tokens(self, grammar: GrammarBitmask | None, non_block: Literal[False] = False) -> ModelRunnerOutput: ...

    @overload
    def sample_tokens(self, grammar: GrammarBitmask | None, non_block: Literal[True]) -> Future[ModelRunnerOutput]: ...

    def sample_tokens(self, grammar: GrammarBitmask | None, non_block: bool = False,
                      ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        """The last forward's output, sampled within ``grammar``: the sampling rank's (the only
        one that samples: rank 0, or the last pipeline stage's first rank).

        ``non_block``: return a future of it at once (the engine core's micro-batches under
        pipeline parallelism: it schedules the next step while this one runs)."""
        if non_block:
            return picked(self.collective_rpc("sample_tokens", (grammar,), non_block=True), self.spec.sampling_rank)
        outputs: list[ModelRunnerOutput] = self.collective_rpc("sample_tokens", (grammar,))
        output = outputs[self.spec.sampling_rank]
        if len(outputs) > 1 and any(o.kv_connector_output is not None for o in outputs):
            # each rank moves its own slice of the KV: a transfer is done once every rank's is
            if getattr(self, "_kv_outputs", None) is None:
                self._kv_outputs = KVOutputAggregator(len(outputs))
            output.kv_connector_output = self._kv_outputs.merge([o.kv_connector_output for o in outputs])
        return output

    def shutdown(self) -> None:
        """Release workers and device memory."""
        self.collective_rpc("shutdown")


def completed(value: T) -> Future[T]:
    """An already-resolved future: what an executor that ran the call in place returns for ``non_block``."""
    future: Future[T] = Future()
    future.set_result(value)
    return future


def failed(exc: BaseException) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_exception(exc)
    return future


def picked(future: Future[list[T]], index: int) -> Future[T]:
    """A future of item ``index`` of ``future``'s list (or of its exception)."""
    item: Future[T] = Future()

    def forward(done: Future[list[T]]) -> None:
        error = done.exception()
        if error is not None:
            item.set_exception(error)
        else:
            item.set_result(done.result()[index])

    future.add_done_callback(forward)
    return item
