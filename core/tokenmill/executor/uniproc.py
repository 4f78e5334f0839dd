"""The in-process executor: one worker, in the engine's own process."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenmill.executor.base import Executor, completed, failed
from tokenmill.model_loader.checkpoint import Checkpoint
from tokenmill.platform import Platform
from tokenmill.plugins.manager import PluginManager
from tokenmill.worker.spec import WorkerSpec
from tokenmill.worker.worker import Worker


class UniProcExecutor(Executor):
    """One :class:`Worker`, built from the spec with the engine's own plugin manager, platform
    and checkpoint (the worker loads the weights).

    A non-blocking call runs in place all the same and returns a completed future: the
    forward must stay on the thread that built the model, since on the CPU platform the
    OpenMP teams belong to that thread and another thread runs 1.5-1.8x slower
    (docs/operations.md).
    """

    def __init__(self, spec: WorkerSpec, plugins: PluginManager | None = None, platform: Platform | None = None,
                 checkpoint: Checkpoint | None = None, progress: bool = False, **worker_args: Any) -> None:
        super().__init__(spec)
        if spec.config.world_size > 1:
            raise ValueError(f"distributed_executor_backend 'uni' runs one rank, not tensor_parallel_size="
                             f"{spec.config.tensor_parallel_size} x pipeline_parallel_size="
                             f"{spec.config.pipeline_parallel_size}: use 'mp' (the default for more than one rank)")
        self.worker = Worker(spec, plugins=plugins, platform=platform, checkpoint=checkpoint, progress=progress)

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple[Any, ...] = (),
                       kwargs: dict[str, Any] | None = None, non_block: bool = False,
                       ) -> Any:  # list[Any] | Future[list[Any]], as the overloads say
        if not non_block:
            return [self.worker.execute_method(method, args, kwargs)]
        try:
            return completed([self.worker.execute_method(method, args, kwargs)])
        except Exception as exc:
            return failed(exc)

