"""Options that take several values after one flag, as argparse's ``nargs='+'`` (vLLM's
``--lora-modules a=x b=y``), which click has no way to declare.

Click reads one value per occurrence of an option, so before it parses, the arguments are
rewritten: ``--lora-modules a=x b=y`` becomes ``--lora-modules a=x --lora-modules b=y``, and
the command sees the repeated option it already takes. After the first value, an argument is
another value only while it looks like one (``name=path`` or a JSON object): the model argument
may follow the option, as in ``tokenmill serve --lora-modules a=x ./base``, and stays the model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from typer.core import TyperCommand


def looks_like_lora_module(arg: str) -> bool:
    """``name=path`` or ``{"name": ..., "path": ...}``: a further ``--lora-modules`` value (a
    malformed one too, so that its own error names it)."""
    return "=" in arg or arg.lstrip().startswith("{")


# option -> the test a further argument must pass to be one more of its values
SEVERAL_VALUES: dict[str, Callable[[str], bool]] = {"--lora-modules": looks_like_lora_module}


def spread_values(args: list[str], options: Mapping[str, Callable[[str], bool]] = SEVERAL_VALUES) -> list[str]:
    """``args`` with each run of values after one of ``options`` given one flag apiece. The
    value right after the flag is taken whatever it is (click's own reading); the ones after it
    while they pass the option's test and are no option themselves."""
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":  # what follows is positional, whatever it looks like
            return [*out, *args[i:]]
        name = arg.partition("=")[0]
        further = options.get(name)
        if further is None:
            out.append(arg)
            i += 1
            continue
        first = 2 if arg == name else 1  # --flag VALUE, or --flag=VALUE
        out += args[i : i + first]
        i += first
        while i < len(args) and not args[i].startswith("-") and further(args[i]):
            out += [name, args[i]]
            i += 1
    return out


class SeveralValuesCommand(TyperCommand):
    """A typer command whose :data:`SEVERAL_VALUES` options also take their values after one flag."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:  # ctx: the click Context typer vendors
        return super().parse_args(ctx, spread_values(args))
