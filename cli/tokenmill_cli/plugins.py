"""``tokenmill plugins``: what is installed, where it came from, what it registers, and the hooks
this version declares (from :mod:`tokenmill.hookspecs`, so no list is kept here)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from tokenmill.hookspecs import NOT_CALLED, hook_names, is_experimental

# What a registration hook may be called with here: the chosen platform and nothing else.
_REGISTRATION_ARGS = frozenset({"platform"})


def list_plugins(
    strict: Annotated[bool, typer.Option("--strict-plugins", help="Fail when a plugin cannot be loaded")] = False,
    head_size: Annotated[int, typer.Option(help="The model's head size, for the attention backends' order")] = 128,
    dtype: Annotated[str, typer.Option(help="The model's dtype for that order ('auto': the platform's)")] = "auto",
    model: Annotated[str | None, typer.Option(help="A model folder: its head size, sliding window and soft cap "
                                                   "set that order (instead of --head-size)")] = None,
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
        hooks = ", ".join(_hook_label(h) for h in manager.hooks_of(name))
        table.add_row(name, info.distribution, info.version, hooks, "\n".join(registered.get(name, [])))  # one hook a line
    console = Console(width=160)
    console.print(table)
    console.print(_hooks_table(manager))
    console.print(_attention_order_table(manager, dtype, *_attention_needs_of(model, head_size)))
    for failure in manager.failures:
        console.print(f"[red]failed[/red] {failure.info.label}: {failure.error}")


def _hook_label(hook: str) -> str:
    """A hook's short name, flagged where this version never calls it."""
    short = hook.removeprefix("tokenmill_")
    return f"{short} ({NOT_CALLED})" if is_experimental(hook) else short


def _hooks_table(manager: Any) -> Any:
    """Every declared hook: how it is called, what it takes, how many plugins implement it."""
    from rich.table import Table

    table = Table(title="hooks")
    for column in ("hook", "kind", "arguments", "implementations", "note"):
        table.add_column(column)
    for hook in hook_names():
        caller = getattr(manager.hook, hook)
        kind = "firstresult" if caller.spec.opts.get("firstresult") else "collect"
        note = f"experimental: {NOT_CALLED}" if is_experimental(hook) else ""
        table.add_row(hook, kind, ", ".join(caller.spec.argnames), str(len(caller.get_hookimpls())), note)
    return table


def _attention_needs_of(model: str | None, head_size: int) -> tuple[int, bool, bool]:
    """``(head size, sliding window, soft cap)`` of the model folder's config.json, or the defaults."""
    if model is None:
        return head_size, False, False
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(size), bool(getattr(config, "sliding_window", None)), \
        getattr(config, "attn_logit_softcapping", None) is not None


def _attention_order_table(manager: Any, dtype: str, head_size: int, sliding_window: bool = False,
                           logits_soft_cap: bool = False) -> Any:
    """The attention backends in the order the engine would try them on this machine's platform."""
    from rich.table import Table

    from tokenmill.attention import AttentionRequirements
    from tokenmill.attention.selection import describe_device, rank_backends
    from tokenmill.platform import detect_platform, resolve_dtype

    platform = detect_platform(manager)
    device = describe_device(platform)
    dtype_name = str(resolve_dtype(dtype, platform)).removeprefix("torch.")
    needs = AttentionRequirements(device_type=device.device_type, dtype=dtype_name, head_size=head_size,
                                  sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    specs = [spec for _, spec in manager.collect_named("tokenmill_register_attention_backends",
                                                       platform=platform).values()]
    capability = "" if device.compute_capability is None else f", compute capability {device.compute_capability}"
    table = Table(title=f"attention backends on {device.platform}{capability} ({dtype_name}, head size {head_size})")
    for column in ("order", "backend", "priority", "here"):
        table.add_column(column)
    order = 0
    for ranked in rank_backends(specs, needs, device):
        order += ranked.reason is None
        table.add_row(str(order) if ranked.reason is None else "-", ranked.spec.name, str(ranked.priority),
                      ranked.reason or "runs (built in this order until one starts)")
    return table


def _registration_hooks(manager: Any) -> list[str]:
    """The hooks whose answers name things: those taking nothing but the platform."""
    return [hook for hook in hook_names()
            if set(getattr(manager.hook, hook).spec.argnames) <= _REGISTRATION_ARGS]


def _label(hook: str) -> str:
    """``tokenmill_register_tool_parsers`` -> ``tool-parsers``; ``tokenmill_detect_platform`` -> ``platform``."""
    short = hook.removeprefix("tokenmill_")
    for verb in ("register_", "detect_", "add_"):
        short = short.removeprefix(verb)
    return short.replace("_", "-")


def _names(value: Any) -> list[str]:
    """What one hook answer names: dict keys, spec names, or a path (the default model)."""
    if isinstance(value, dict):
        return list(value)
    if isinstance(value, str):
        return [value.rsplit("/", 1)[-1]]
    if hasattr(value, "name"):
        return [_spec_label(value)]
    return [_spec_label(spec) for spec in value]


def _spec_label(spec: Any) -> str:
    """A spec's name, with where it runs for those that say (quantization methods)."""
    if not hasattr(spec, "devices"):
        return str(spec.name)
    devices, dtypes = ", ".join(spec.devices) or "any device", ", ".join(spec.dtypes) or "any dtype"
    return f"{spec.name} ({devices}; {dtypes})"


def _registered_names(manager: Any) -> dict[str, list[str]]:
    """``plugin name -> ["models: A, B", ...]`` from every registration hook."""
    from tokenmill.platform import detect_platform

    platform = detect_platform(manager)
    out: dict[str, list[str]] = {}
    for hook in _registration_hooks(manager):
        args = {"platform": platform} if "platform" in getattr(manager.hook, hook).spec.argnames else {}
        for result in manager.collect(hook, **args):
            names = _names(result.value)
            out.setdefault(result.plugin.name, []).append(f"{_label(hook)}: {', '.join(names)}")
    return out
