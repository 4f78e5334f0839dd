"""Classes that plugins register by name (``{name: "module:Class"}`` hooks), loaded when chosen.

The tool-call and reasoning parsers are two such registries: the same lookup, the same error
listing what is registered, only the hook and the words of the error differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from tokenmill.errors import InvalidRequestError

if TYPE_CHECKING:
    from tokenmill.plugins.manager import PluginManager

T = TypeVar("T")


@dataclass(frozen=True)
class NamedClasses(Generic[T]):
    """The classes of one ``{name: qualname}`` hook.

    :param hook: the registration hook (``tokenmill_register_tool_parsers``).
    :param kind: what a class is, for the error (``"tool-call parser"``).
    :param param: the option or request field that named it, for the error.
    :param distribution: the package to suggest when nothing is registered.
    """

    hook: str
    kind: str
    param: str
    distribution: str

    def names(self, plugins: PluginManager | None = None) -> list[str]:
        """Every registered name, sorted."""
        return sorted(_plugins(plugins).collect_named(self.hook))

    def load(self, name: str, plugins: PluginManager | None = None) -> type[T]:
        """The class registered as ``name``; an unknown name is an error listing the known ones."""
        from tokenmill.plugins.specs import resolve_qualname

        registered = _plugins(plugins).collect_named(self.hook)
        if name not in registered:
            known = ", ".join(sorted(registered)) or f"none (install {self.distribution})"
            raise InvalidRequestError(f"unknown {self.kind} {name!r}; registered: {known}", param=self.param)
        _, qualname = registered[name]
        cls: Any = resolve_qualname(qualname)
        return cls  # type: ignore[no-any-return]


def _plugins(plugins: PluginManager | None) -> PluginManager:
    if plugins is not None:
        return plugins
    from tokenmill.plugins.manager import get_plugin_manager

    return get_plugin_manager()
