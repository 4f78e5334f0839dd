"""Asking the engine's workers about themselves, through the executor's ``collective_rpc``
(what a test may know of a worker that could run in another process), not its attributes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def on_rank_zero(llm: Any, method: str | Callable[..., Any], *args: Any) -> Any:
    """``method`` (a Worker method's name, or a function given the worker) run on every worker: rank 0's answer."""
    return llm.engine.core.executor.collective_rpc(method, args)[0]


def attention_backend(llm: Any) -> str:
    return on_rank_zero(llm, "attention_backend_name")


def graph_batch_sizes(llm: Any) -> list[int] | None:
    """The decode batch sizes captured as step graphs; None where the runner has no step graphs."""
    return on_rank_zero(llm, _graph_batch_sizes)


def _graph_batch_sizes(worker: Any) -> list[int] | None:
    graphs = worker.runner.graphs
    return None if graphs is None else list(graphs.batch_sizes)


def runner(llm: Any) -> Any:
    """Rank 0's model runner itself, for the step-graph tests' finer checks (in-process executors only)."""
    return on_rank_zero(llm, _runner)


def _runner(worker: Any) -> Any:
    return worker.runner


def worker_pids(llm: Any) -> list[int]:
    """The process id of every worker, in rank order (of an ``LLM`` or an ``AsyncLLM``)."""
    return llm.engine.core.executor.collective_rpc(_pid)


def _pid(worker: Any) -> int:
    import os

    return os.getpid()


def communicator_kinds(llm: Any) -> list[str]:
    """The class of every rank's tensor-parallel communicator (the platform's choice), in rank order."""
    return llm.engine.core.executor.collective_rpc(_communicator_kind)


def _communicator_kind(worker: Any) -> str:
    return type(worker.comm).__name__
