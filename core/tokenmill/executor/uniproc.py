"""The in-process executor: one worker, in the engine's own process."""

from __future__ import annotations

from tokenmill.config import EngineConfig
from tokenmill.executor.base import Executor
from tokenmill.platform import Platform, platform_kv_prefault_bytes
from tokenmill.scheduler.output import ModelRunnerOutput, SchedulerOutput
from tokenmill.worker.model_runner import ModelRunner
from tokenmill.worker.worker import create_model_runner


class UniProcExecutor(Executor):
    """Builds the model in this process; ``worker_args`` go to :func:`create_model_runner`."""

    def __init__(self, config: EngineConfig, platform: Platform, **worker_args: object) -> None:
        self.config = config
        self.platform = platform
        self.runner: ModelRunner = create_model_runner(config, platform, **worker_args)  # type: ignore[arg-type]

    def kv_bytes_per_block(self) -> int:
        return self.runner.kv_bytes_per_block()

    def kv_cache_budget(self) -> int:
        return self.platform.kv_cache_bytes(self.config)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        # An optional platform capability (KVCachePrefault): how much of the cache to fault in now.
        self.runner.allocate_kv_cache(num_blocks, platform_kv_prefault_bytes(self.platform, self.config))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        self.runner.kv_caches.clear()
