"""Executors: where the model runs."""

from tokenmill.executor.base import Executor
from tokenmill.executor.uniproc import UniProcExecutor

__all__ = ["Executor", "UniProcExecutor"]
