"""Choosing the executor by name, among those plugins register (``tokenmill_register_executors``)."""

from __future__ import annotations

from typing import Any

from tokenmill.errors import PluginError
from tokenmill.executor.base import Executor
from tokenmill.plugins.manager import PluginManager
from tokenmill.plugins.specs import resolve_qualname
from tokenmill.worker.spec import WorkerSpec


def executor_class(plugins: PluginManager, name: str) -> type[Executor]:
    """The registered executor class called ``name``; an unknown name lists the registered ones."""
    registered = plugins.collect_named("tokenmill_register_executors")
    if name not in registered:
        raise ValueError(f"unknown distributed_executor_backend {name!r}; registered executors: "
                         f"{', '.join(sorted(registered)) or '(none)'}")
    plugin, qualname = registered[name]
    cls = resolve_qualname(qualname)
    if not (isinstance(cls, type) and issubclass(cls, Executor)):
        raise PluginError(f"executor {name!r} of {plugin.label} is {qualname}, not a tokenmill Executor subclass")
    return cls


def create_executor(plugins: PluginManager, spec: WorkerSpec, **worker_args: Any) -> Executor:
    return executor_class(plugins, spec.config.distributed_executor_backend)(spec, plugins=plugins, **worker_args)
