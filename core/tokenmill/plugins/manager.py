"""Discovering plugins through entry points and calling their hooks.

Plugins come from the ``tokenmill.plugins`` entry-point group. ``TOKENMILL_PLUGINS``
(a comma-separated allow-list) and ``TOKENMILL_BLOCK_PLUGINS`` (names to skip)
narrow the set; a plugin that fails to import is reported with its distribution
and version and skipped, unless ``strict`` is set, which makes it fatal.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import pluggy

from tokenmill import hookspecs
from tokenmill.errors import PluginError

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "tokenmill.plugins"
ALLOW_ENV = "TOKENMILL_PLUGINS"
BLOCK_ENV = "TOKENMILL_BLOCK_PLUGINS"
CORE_PLUGIN_NAME = "tokenmill-core-defaults"


@dataclass(frozen=True)
class PluginInfo:
    """Where a loaded plugin came from."""

    name: str
    distribution: str
    version: str
    module: str

    @property
    def label(self) -> str:
        return f"{self.name} ({self.distribution} {self.version})"


@dataclass(frozen=True)
class PluginFailure:
    """A plugin that could not be loaded, and why."""

    info: PluginInfo
    error: str


@dataclass
class HookResult:
    """One implementation's answer to a collect hook."""

    plugin: PluginInfo
    value: Any


@dataclass
class PluginManager:
    """A pluggy manager plus provenance for every registered plugin."""

    strict: bool = False
    allow: frozenset[str] | None = None
    block: frozenset[str] = frozenset()
    pm: pluggy.PluginManager = field(init=False)
    infos: dict[str, PluginInfo] = field(init=False, default_factory=dict)
    failures: list[PluginFailure] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        from tokenmill.plugins import defaults

        self.register(defaults, PluginInfo(CORE_PLUGIN_NAME, "tokenmill-core", _version("tokenmill-core"), defaults.__name__))

    # -- loading ---------------------------------------------------------
    def load_entry_points(self, eps: Iterable[EntryPoint] | None = None) -> None:
        for ep in eps if eps is not None else entry_points(group=ENTRY_POINT_GROUP):
            if not self._wanted(ep.name):
                continue
            info = _info_for(ep)
            try:
                plugin = ep.load()
                _check_api_version(plugin)
                self.register(plugin, info)
            except Exception as exc:  # a broken plugin must not take the engine down
                self._fail(info, exc)

    def register(self, plugin: Any, info: PluginInfo) -> None:
        if info.name in self.infos:
            other = self.infos[info.name]
            raise PluginError(f"plugin name {info.name!r} is claimed by {other.label} and {info.label}")
        self.pm.register(plugin, name=info.name)
        self.infos[info.name] = info

    def _wanted(self, name: str) -> bool:
        if name in self.block:
            return False
        return self.allow is None or name in self.allow

    def _fail(self, info: PluginInfo, exc: Exception) -> None:
        message = f"plugin {info.label} failed to load: {type(exc).__name__}: {exc}"
        if self.strict:
            raise PluginError(message) from exc
        logger.warning(message)
        self.failures.append(PluginFailure(info, f"{type(exc).__name__}: {exc}"))

    # -- calling ---------------------------------------------------------
    @property
    def hook(self) -> Any:
        return self.pm.hook

    def collect(self, hook_name: str, **kwargs: Any) -> list[HookResult]:
        """Call every implementation of a hook, keeping each non-``None`` answer and who gave it.

        Each implementation is called through pluggy's own call loop (tracing, hook
        wrappers, argument selection), on a subset caller that holds only it: the
        loop answers a plain list without saying which implementation gave which
        entry, and the provenance is what ``tokenmill plugins`` shows and what a
        duplicate name's error cites. Implementations run in pluggy's order.
        """
        caller = self._checked_caller(hook_name, kwargs)
        plain = [impl for impl in caller.get_hookimpls() if not (impl.hookwrapper or impl.wrapper)]
        results: list[HookResult] = []
        for impl in reversed(plain):  # pluggy calls the last registered (and tryfirst) first
            only = self.pm.subset_hook_caller(hook_name, [other.plugin for other in plain if other is not impl])
            answer = only(**kwargs)
            for value in [answer] if caller.spec is not None and caller.spec.opts.get("firstresult") else answer:
                if value is not None:
                    results.append(HookResult(self.infos[impl.plugin_name], value))
        return results

    def _checked_caller(self, hook_name: str, kwargs: dict[str, Any]) -> pluggy.HookCaller:
        """The caller of a declared hook; a misspelled hook or argument name fails here, at once."""
        caller = getattr(self.pm.hook, hook_name, None)
        if caller is None or caller.spec is None:
            raise PluginError(f"{hook_name!r} is not a tokenmill hook; the hooks are {hookspecs.hook_names()}")
        unknown = sorted(set(kwargs) - set(caller.spec.argnames))
        if unknown:
            raise PluginError(f"{hook_name} takes {list(caller.spec.argnames)}, not {unknown}")
        return caller

    def collect_named(self, hook_name: str, **kwargs: Any) -> dict[str, tuple[PluginInfo, Any]]:
        """Merge ``{name: spec}`` answers (dicts, or lists of specs with ``.name``).

        Two plugins answering the same name is an error naming both.
        """
        merged: dict[str, tuple[PluginInfo, Any]] = {}
        for result in self.collect(hook_name, **kwargs):
            for name, spec in _named_items(result.value):
                if name in merged:
                    first = merged[name][0]
                    raise PluginError(
                        f"{hook_name}: {name!r} is registered by both {first.label} and {result.plugin.label}"
                    )
                merged[name] = (result.plugin, spec)
        return merged

    def hooks_of(self, name: str) -> list[str]:
        plugin = self.pm.get_plugin(name)
        return sorted(h.name for h in self.pm.get_hookcallers(plugin) or [])


def _named_items(value: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        yield from value.items()
    else:
        for spec in value:
            yield spec.name, spec


def _info_for(ep: EntryPoint) -> PluginInfo:
    dist = ep.dist
    return PluginInfo(
        name=ep.name,
        distribution=dist.name if dist else "unknown",
        version=dist.version if dist else "unknown",
        module=ep.value,
    )


def _check_api_version(plugin: Any) -> None:
    declared = getattr(plugin, "TOKENMILL_PLUGIN_API", hookspecs.PLUGIN_API_VERSION)
    if int(declared) != hookspecs.PLUGIN_API_VERSION:
        raise PluginError(
            f"declares plugin API {declared}, this tokenmill speaks {hookspecs.PLUGIN_API_VERSION}"
        )


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "unknown"


def _env_set(var: str) -> frozenset[str] | None:
    raw = os.environ.get(var)
    if raw is None:
        return None
    return frozenset(part.strip() for part in raw.split(",") if part.strip())


_DEFAULT: PluginManager | None = None


def get_plugin_manager(strict: bool | None = None, *, reload: bool = False) -> PluginManager:
    """The process-wide plugin manager, loaded from entry points on first use."""
    global _DEFAULT
    if _DEFAULT is None or reload or (strict and not _DEFAULT.strict):
        manager = PluginManager(
            strict=bool(strict) or os.environ.get("TOKENMILL_STRICT_PLUGINS") == "1",
            allow=_env_set(ALLOW_ENV),
            block=_env_set(BLOCK_ENV) or frozenset(),
        )
        manager.load_entry_points()
        _DEFAULT = manager
    return _DEFAULT
