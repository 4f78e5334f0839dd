"""Choosing a KV connector by name from the plugins' specs and building its halves."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenmill.plugins.specs import KVConnectorSpec, resolve_qualname

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.kv_transfer.connector import KVConnectorContext, KVConnectorScheduler, KVConnectorWorker
    from tokenmill.plugins.manager import PluginManager


def kv_connectors(plugins: PluginManager) -> dict[str, KVConnectorSpec]:
    """Every registered connector by name; two plugins claiming one name is an error naming both."""
    named = plugins.collect_named("tokenmill_register_kv_connectors")
    return {name: spec for name, (_plugin, spec) in named.items()}


def connector_spec(plugins: PluginManager, name: str) -> KVConnectorSpec:
    """The spec of connector ``name``, or an error listing the installed ones."""
    connectors = kv_connectors(plugins)
    spec = connectors.get(name)
    if spec is None:
        known = ", ".join(sorted(connectors)) or "none installed"
        raise ValueError(f"unknown KV connector {name!r} (known: {known})")
    return spec


def check_connector(spec: KVConnectorSpec, config: EngineConfig) -> None:
    """Refuse a layout the connector cannot move: more than one tensor-parallel rank unless it says it can."""
    if config.tensor_parallel_size > 1 and not spec.tensor_parallel:
        raise ValueError(f"KV connector {spec.name!r} runs with one worker rank only (it does not declare "
                         "tensor_parallel: each rank moving its own KV heads)")


def build_scheduler_connector(plugins: PluginManager, context: KVConnectorContext) -> KVConnectorScheduler:
    spec = connector_spec(plugins, context.transfer_config.kv_connector)
    return _build(spec.scheduler_qualname, context)


def build_worker_connector(plugins: PluginManager, context: KVConnectorContext) -> KVConnectorWorker:
    spec = connector_spec(plugins, context.transfer_config.kv_connector)
    return _build(spec.worker_qualname, context)


def _build(qualname: str, context: KVConnectorContext) -> Any:
    return resolve_qualname(qualname)(context)
