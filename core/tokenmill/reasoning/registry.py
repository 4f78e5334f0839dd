"""Reasoning parsers by name, from the plugins' ``tokenmill_register_reasoning_parsers`` answers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.errors import InvalidRequestError

if TYPE_CHECKING:
    from tokenmill.plugins.manager import PluginManager
    from tokenmill.reasoning.base import ReasoningParser

HOOK = "tokenmill_register_reasoning_parsers"


def reasoning_parser_names(plugins: PluginManager | None = None) -> list[str]:
    """Every registered parser name, sorted."""
    return sorted(_plugins(plugins).collect_named(HOOK))


def load_reasoning_parser(name: str, plugins: PluginManager | None = None) -> type[ReasoningParser]:
    """The parser class registered as ``name``; an unknown name is an error listing the known ones."""
    from tokenmill.plugins.specs import resolve_qualname

    registered = _plugins(plugins).collect_named(HOOK)
    if name not in registered:
        known = ", ".join(sorted(registered)) or "none (install tokenmill-reasoning-parsers)"
        raise InvalidRequestError(f"unknown reasoning parser {name!r}; registered: {known}",
                                  param="reasoning_parser")
    _, qualname = registered[name]
    return resolve_qualname(qualname)


def _plugins(plugins: PluginManager | None) -> PluginManager:
    if plugins is not None:
        return plugins
    from tokenmill.plugins.manager import get_plugin_manager

    return get_plugin_manager()
