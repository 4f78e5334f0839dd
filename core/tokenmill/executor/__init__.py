"""Executors: where the model runs, chosen by name (``distributed_executor_backend``)."""

from tokenmill.executor.base import Executor
from tokenmill.executor.registry import create_executor
from tokenmill.executor.uniproc import UniProcExecutor

__all__ = ["Executor", "UniProcExecutor", "create_executor"]
