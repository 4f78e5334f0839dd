"""Executors written against the seam alone: ``collective_rpc`` and a worker spec."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

from tokenmill.plugin_api import Executor, UniProcExecutor, Worker, WorkerSpec


def _call_name(method: str | Callable[..., Any]) -> str:
    return method if isinstance(method, str) else getattr(method, "__name__", repr(method))


class RecordingExecutor(UniProcExecutor):
    """The in-process executor; ``calls`` lists every RPC it forwarded, in order."""

    def __init__(self, spec: WorkerSpec, **worker_args: Any) -> None:
        self.calls: list[str] = []
        super().__init__(spec, **worker_args)

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple[Any, ...] = (),
                       kwargs: dict[str, Any] | None = None, non_block: bool = False) -> Any:
        self.calls.append(_call_name(method))
        return super().collective_rpc(method, args, kwargs, non_block)


class InProcessRanksExecutor(Executor):
    """``WORLD_SIZE`` workers in this process, rank order; each built from an unpickled spec
    and nothing of the engine's (its own plugin manager, platform and checkpoint)."""

    WORLD_SIZE = 2

    def __init__(self, spec: WorkerSpec, **worker_args: Any) -> None:
        super().__init__(spec)
        self.calls: list[str] = []
        self.workers = [Worker(pickle.loads(pickle.dumps(self._rank_spec(spec, rank))))
                        for rank in range(self.WORLD_SIZE)]

    def _rank_spec(self, spec: WorkerSpec, rank: int) -> WorkerSpec:
        spec = replace(spec, world_size=self.WORLD_SIZE).for_rank(rank)
        memory = spec.config.kv_cache_memory
        if rank > 0 and memory is not None:  # a rank with less room: the cache must fit it too
            spec = replace(spec, config=spec.config.model_copy(update={"kv_cache_memory": memory // 2}))
        return spec

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple[Any, ...] = (),
                       kwargs: dict[str, Any] | None = None, non_block: bool = False) -> Any:
        self.calls.append(_call_name(method))
        if not non_block:
            return [worker.execute_method(method, args, kwargs) for worker in self.workers]
        future: Future[list[Any]] = Future()
        try:
            future.set_result([worker.execute_method(method, args, kwargs) for worker in self.workers])
        except Exception as exc:  # the caller sees it through the future
            future.set_exception(exc)
        return future
