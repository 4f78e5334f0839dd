"""``--config FILE.yaml``: a command's options read from a YAML file, as vLLM's ``--config`` does.

The file maps option names to values (``max-num-seqs: 8`` or ``max_num_seqs: 8``; a plugin's
option by its key, ``toy.greeting: hi``). Its values become the options' defaults (click's
``default_map``), so they go through the same parsing as typed values and a flag on the command
line overrides the file. ``--config`` is eager: the file is read before any other option.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import typer


def config_file_parameter(names: Mapping[str, str]) -> inspect.Parameter:
    """The ``--config`` parameter of a command; ``names`` maps each key a file may use (underscores
    for dashes) to the command's parameter name."""

    def load(ctx: typer.Context, path: Path | None) -> Path | None:
        if path is not None:
            ctx.default_map = {**(ctx.default_map or {}), **read_config_file(path, names)}
        return path

    option = typer.Option("--config", help="YAML file of options (keys: option names); flags given here override it",
                          is_eager=True, callback=load, exists=True, dir_okay=False)
    return inspect.Parameter("config_file", inspect.Parameter.KEYWORD_ONLY, default=None,
                             annotation=Annotated[Path | None, option])


def read_config_file(path: Path, names: Mapping[str, str]) -> dict[str, Any]:
    """The file as ``{parameter name: value}``; an unknown key is a ``BadParameter`` naming it."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise typer.BadParameter(f"{path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise typer.BadParameter(f"{path} must map option names to values, not hold a {type(data).__name__}")
    values = {}
    for key, value in data.items():
        name = names.get(str(key).replace("-", "_"))
        if name is None:
            raise typer.BadParameter(f"unknown key {key!r} in {path}: keys are this command's option names "
                                     "(see --help), with dashes or underscores")
        values[name] = value
    return values
