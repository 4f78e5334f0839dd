"""The executor seam: where the model runs (this process, TP worker
processes, Ray actors). The engine core only speaks this interface."""

from __future__ import annotations

from abc import ABC, abstractmethod

from tokenmill.scheduler.output import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    @abstractmethod
    def kv_bytes_per_block(self) -> int:
        """KV bytes one block takes across all layers (per worker)."""

    @abstractmethod
    def kv_cache_budget(self) -> int:
        """Bytes the KV cache may use, as the platform measures it after loading."""

    @abstractmethod
    def allocate_kv_cache(self, num_blocks: int) -> None: ...

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    @abstractmethod
    def shutdown(self) -> None:
        """Release workers and device memory."""
