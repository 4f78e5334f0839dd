"""The options plugins add (``tokenmill_add_options``): collected once, keyed ``"<plugin>.<name>"``.

``EngineConfig.plugin_options`` holds their values under those keys. The CLI makes one
``--<plugin>.<name>`` option of each; the engine checks the values when it starts
(:func:`resolve_plugin_options`) and hands the completed dict to every process through the config.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import TypeAdapter, ValidationError

from tokenmill.errors import ConfigError, PluginError
from tokenmill.plugins.manager import PluginManager
from tokenmill.plugins.specs import OptionSpec


def plugin_option_specs(plugins: PluginManager) -> dict[str, OptionSpec]:
    """Every plugin option, keyed ``"<plugin>.<name>"`` (the plugin's entry-point name)."""
    specs: dict[str, OptionSpec] = {}
    for result in plugins.collect("tokenmill_add_options"):
        for spec in result.value:
            key = f"{result.plugin.name}.{spec.name}"
            if key in specs:
                raise PluginError(f"{result.plugin.label} adds the option {spec.name!r} twice")
            specs[key] = spec
    return specs


def resolve_plugin_options(given: Mapping[str, Any], specs: Mapping[str, OptionSpec]) -> dict[str, Any]:
    """``given`` checked against ``specs`` and completed with their defaults.

    An unknown key or a value its spec's type rejects raises :class:`ConfigError` naming the key.
    """
    if unknown := sorted(set(given) - set(specs)):
        known = ", ".join(sorted(specs)) or "none"
        raise ConfigError(f"unknown plugin option(s) {', '.join(unknown)}; the installed plugins add: {known}")
    resolved = {key: spec.default for key, spec in specs.items()}
    for key, value in given.items():
        try:
            resolved[key] = TypeAdapter(specs[key].type).validate_python(value)
        except ValidationError as exc:
            reason = exc.errors()[0]["msg"]
            raise ConfigError(f"plugin option {key}: {reason} (got {value!r})") from exc
    return resolved
