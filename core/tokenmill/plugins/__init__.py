"""Plugin discovery (entry points), hook calls and spec records."""

from tokenmill.plugins.manager import PluginManager, get_plugin_manager
from tokenmill.plugins.specs import (
    AttentionBackendSpec,
    KVConnectorSpec,
    ModelSpec,
    OptionSpec,
    PlatformSpec,
    QuantMethodSpec,
    SpecDecodeSpec,
    resolve_qualname,
)

__all__ = [
    "AttentionBackendSpec",
    "KVConnectorSpec",
    "ModelSpec",
    "OptionSpec",
    "PlatformSpec",
    "PluginManager",
    "QuantMethodSpec",
    "SpecDecodeSpec",
    "get_plugin_manager",
    "resolve_qualname",
]
