"""Engine options, generated: one command-line option per ``EngineConfig`` field and per plugin option.

``engine_command(command, config_cls)`` hands typer ``command`` with its ``engine: EngineConfig``
parameter replaced, in the signature typer reads (``__signature__``), by

* one option per field of ``config_cls``: ``--max-num-seqs`` for ``max_num_seqs``, with the
  field's type, default and description as help; a ``bool`` is an on/off pair
  (``--enable-prefix-caching/--no-enable-prefix-caching``); a dict, list or model field takes
  JSON (``--speculative-config '{"method": "ngram"}'``); ``tokenmill.config.cli`` names the help
  panel, and a metavar for a field that reads text itself (``--kv-cache-memory 2GiB``);
* one option per ``OptionSpec`` a plugin adds (``tokenmill_add_options``): ``--<plugin>.<name>``,
  underscores written as dashes, its value going to ``plugin_options["<plugin>.<name>"]``;
* ``--config FILE.yaml`` (:mod:`tokenmill_cli.config_file`), whose keys become the defaults of
  any of the command's options, so the command line overrides the file.

When the command runs, the values the user gave (command line, environment or file) build one
``config_cls``, validated once: a value it rejects is a ``BadParameter`` naming its option (exit 2).
The command receives it as ``engine`` with only those fields set, so
``engine.model_dump(exclude_unset=True)`` are the keyword arguments that build it again
(``LLM(**...)``). A command that spells a field its own way passes a typer parameter for it:
``engine_command(serve, model=typer.Argument())`` makes the model positional.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Mapping
from copy import copy
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
import typer
from pydantic import TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from typer.models import OptionInfo, ParameterInfo

from tokenmill.config import EngineConfig
from tokenmill.errors import PluginError
from tokenmill.plugins.manager import get_plugin_manager
from tokenmill.plugins.options import plugin_option_specs
from tokenmill_cli.config_file import config_file_parameter

_DEFAULT_PANEL = "Engine"
_PLUGIN_PANEL = "Plugins"
_SCALARS = (bool, int, float, str, Path)
_CONTEXT = "ctx"
_PLUGIN_OPTIONS = "plugin_options"  # the field the per-plugin options stand in for

# The common spellings of the model: an option of generate and bench, the argument of serve.
MODEL_OPTION = typer.Option("--model", "-m")
MODEL_ARGUMENT = typer.Argument()


@dataclass(frozen=True, eq=False)  # compared (and hashed) by identity: a default may be a dict
class GeneratedOption:
    """One generated parameter and where its value goes: a field, or a plugin option's key."""

    parameter: inspect.Parameter
    key: str
    is_plugin: bool = False


def engine_command(command: Callable[..., Any], config_cls: type[EngineConfig] = EngineConfig,
                   **spelling: ParameterInfo) -> Callable[..., Any]:
    """``command`` as typer sees it: engine options in place of its ``engine`` parameter."""
    if unknown := set(spelling) - set(config_cls.model_fields):
        raise TypeError(f"{command.__name__} spells {sorted(unknown)}, which are not fields of {config_cls.__name__}")
    options = [*field_options(config_cls, spelling), *plugin_options()]
    own = [p for name, p in inspect.signature(command, eval_str=True).parameters.items() if name != "engine"]
    if clashes := {p.name for p in own} & {o.parameter.name for o in options}:
        raise TypeError(f"{command.__name__} declares {sorted(clashes)}, which are engine options")
    file_keys = {p.name: p.name for p in own} | {o.key.replace("-", "_"): o.parameter.name for o in options}

    @functools.wraps(command)
    def run(**values: Any) -> Any:
        ctx = values.pop(_CONTEXT)
        values.pop("config_file")  # read already: its values came in as the options' defaults
        engine_values = {o: values.pop(o.parameter.name) for o in options}
        given = {o: value for o, value in engine_values.items() if _was_given(ctx, o.parameter.name)}
        return command(engine=build_config(config_cls, given, ctx), **values)

    context = inspect.Parameter(_CONTEXT, inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context)
    signature = inspect.Signature([*own, context, config_file_parameter(file_keys), *(o.parameter for o in options)])
    run.__signature__ = signature  # type: ignore[attr-defined]
    run.__annotations__ = {p.name: p.annotation for p in signature.parameters.values()}
    return run


def field_options(config_cls: type[EngineConfig], spelling: Mapping[str, ParameterInfo]) -> Iterator[GeneratedOption]:
    """An option per field of ``config_cls`` (the plugin options stand in for ``plugin_options``)."""
    for name, field in config_cls.model_fields.items():
        if name == _PLUGIN_OPTIONS:
            continue
        hints = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        annotation = _annotation(field.annotation, f"--{name.replace('_', '-')}", field.description,
                                 str(hints.get("cli_panel", _DEFAULT_PANEL)), _bounds(field),
                                 hints.get("cli_metavar"), spelling.get(name))
        default = inspect.Parameter.empty if field.is_required() else field.get_default(call_default_factory=True)
        yield GeneratedOption(_keyword(name, annotation, default), name)


def plugin_options() -> Iterator[GeneratedOption]:
    """An option per ``OptionSpec`` of the installed plugins: ``--<plugin>.<name>`` (none when the
    plugin set is broken: the engine reports that when it starts)."""
    try:
        specs = plugin_option_specs(get_plugin_manager())
    except PluginError:
        return
    for index, (key, spec) in enumerate(specs.items()):
        plugin, _, name = key.rpartition(".")
        flag = f"--{plugin.replace('_', '-')}.{name.replace('_', '-')}"
        annotation = _annotation(spec.type, flag, spec.help, _PLUGIN_PANEL, {}, None, None)
        yield GeneratedOption(_keyword(f"plugin_option_{index}", annotation, spec.default), key, is_plugin=True)


def build_config(config_cls: type[EngineConfig], given: Mapping[GeneratedOption, Any],
                 ctx: typer.Context) -> EngineConfig:
    """One ``config_cls`` from the values the user gave; a bad one is a ``BadParameter`` naming its option."""
    fields = {o.key: value for o, value in given.items() if not o.is_plugin}
    if plugin_values := {o.key: value for o, value in given.items() if o.is_plugin}:
        fields[_PLUGIN_OPTIONS] = plugin_values
    try:
        return config_cls(**fields)
    except ValidationError as exc:
        error = exc.errors()[0]
        loc = [str(part) for part in error["loc"]]
        key = loc[-1] if loc[:1] == [_PLUGIN_OPTIONS] else loc[0] if loc else ""
        name = next((o.parameter.name for o in given if o.key == key), None)
        param: Any = next((p for p in ctx.command.params if p.name == name), None)
        raise typer.BadParameter(error["msg"], ctx=ctx, param=param) from None


def _annotation(annotation: Any, flag: str, help_text: str | None, panel: str, bounds: dict[str, float],
                metavar: object, spelling: ParameterInfo | None) -> Any:
    """``Annotated[type, typer.Option(...)]`` for one option, its click type read from ``annotation``:
    a bool is an on/off pair, a scalar, Literal or Enum keeps its type, anything else takes JSON."""
    inner = _without_none(annotation)
    extra: dict[str, Any] = {}
    if metavar is not None:  # the field's own validator reads the text
        inner, extra = str, {"metavar": str(metavar)}
    elif inner is bool:
        flag = f"{flag}/--no-{flag.removeprefix('--')}"
    elif inner in _SCALARS or get_origin(inner) is Literal or (isinstance(inner, type) and issubclass(inner, Enum)):
        extra = bounds
    else:
        inner, extra = str, {"metavar": "JSON", "parser": _json_parser(annotation)}
    if spelling is None:
        info = typer.Option(flag, help=help_text, rich_help_panel=panel, **extra)
    else:  # the command's own spelling, completed from the field
        info = copy(spelling)
        panel_if_option = panel if isinstance(info, OptionInfo) else None
        for attribute, value in {"help": help_text, "rich_help_panel": panel_if_option, **extra}.items():
            if getattr(info, attribute) is None:
                setattr(info, attribute, value)
    return Annotated[inner | None, info]  # type: ignore[operator]


def _json_parser(annotation: Any) -> Callable[[Any], Any]:
    """JSON text (or, from a YAML file, the value itself) validated as the field's type."""
    adapter: TypeAdapter[Any] = TypeAdapter(annotation)

    def parse(value: Any) -> Any:
        try:
            return adapter.validate_json(value) if isinstance(value, str) else adapter.validate_python(value)
        except ValidationError as exc:
            reasons = (f"{'.'.join(map(str, e['loc'])) + ': ' if e['loc'] else ''}{e['msg']}" for e in exc.errors())
            raise ValueError("; ".join(reasons)) from None

    return parse


def _keyword(name: str, annotation: Any, default: Any) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


def _was_given(ctx: typer.Context, name: str) -> bool:
    """On the command line, in the environment or in the --config file: not left at its default."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name != "DEFAULT"


def _without_none(annotation: Any) -> Any:
    """``int | None`` -> ``int``; typer reads None as "not given" itself."""
    if get_origin(annotation) in (Union, UnionType):
        rest = [arg for arg in get_args(annotation) if arg is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return annotation


def _bounds(field: FieldInfo) -> dict[str, float]:
    """The field's ``ge``/``le`` as typer's ``min``/``max``, so the help shows the range."""
    bounds: dict[str, float] = {}
    for item in field.metadata:
        if isinstance(item, annotated_types.Ge):
            bounds["min"] = item.ge  # type: ignore[assignment]
        elif isinstance(item, annotated_types.Le):
            bounds["max"] = item.le  # type: ignore[assignment]
    return bounds
