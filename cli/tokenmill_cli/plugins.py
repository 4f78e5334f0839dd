"""``tokenmill plugins``: what is installed, where it came from, what it registers."""

from __future__ import annotations

from typing import Annotated, Any

import typer

# registration hooks whose answers name things
_NAMED_HOOKS = {
    "tokenmill_detect_platform": "platform",
    "tokenmill_register_attention_backends": "attention",
    "tokenmill_register_models": "models",
    "tokenmill_register_quantization_methods": "quantization",
    "tokenmill_register_spec_decode_methods": "spec-decode",
    "tokenmill_register_kv_connectors": "kv-connector",
    "tokenmill_register_tool_parsers": "tool-parser",
    "tokenmill_register_reasoning_parsers": "reasoning-parser",
    "tokenmill_register_structured_output_backends": "structured-output",
    "tokenmill_default_model": "default-model",
    "tokenmill_add_options": "options",
}


def list_plugins(
    strict: Annotated[bool, typer.Option("--strict-plugins", help="Fail when a plugin cannot be loaded")] = False,
) -> None:
    from rich.console import Console
    from rich.table import Table

    from tokenmill.errors import PluginError
    from tokenmill.plugins import get_plugin_manager

    try:
        manager = get_plugin_manager(strict=strict, reload=True)
    except PluginError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc
    registered = _registered_names(manager)
    table = Table(title="tokenmill plugins")
    for column in ("plugin", "distribution", "version", "hooks", "registers"):
        table.add_column(column)
    for name, info in sorted(manager.infos.items()):
        hooks = ", ".join(h.removeprefix("tokenmill_") for h in manager.hooks_of(name))
        table.add_row(name, info.distribution, info.version, hooks, "; ".join(registered.get(name, [])))
    console = Console(width=160)
    console.print(table)
    for failure in manager.failures:
        console.print(f"[red]failed[/red] {failure.info.label}: {failure.error}")


def _names(value: Any) -> list[str]:
    """What one hook answer names: dict keys, spec names, or a path (the default model)."""
    if isinstance(value, dict):
        return list(value)
    if isinstance(value, str):
        return [value.rsplit("/", 1)[-1]]
    if hasattr(value, "name"):
        return [value.name]
    return [spec.name for spec in value]


def _registered_names(manager: Any) -> dict[str, list[str]]:
    """``plugin name -> ["models: A, B", ...]`` from every registration hook."""
    from tokenmill.platform import detect_platform

    platform = detect_platform(manager)
    out: dict[str, list[str]] = {}
    for hook, label in _NAMED_HOOKS.items():
        for result in manager.collect(hook, platform=platform):
            names = _names(result.value)
            out.setdefault(result.plugin.name, []).append(f"{label}: {', '.join(names)}")
    return out
