"""``--lora-modules``: several adapters after one flag (vLLM's ``nargs='+'`` form), the flag
repeated, the JSON form, and a malformed item answered with an error that quotes it."""

from __future__ import annotations

import json
from typing import Annotated, Any

import pytest
import typer
from typer.testing import CliRunner

from tokenmill_cli.main import build_app
from tokenmill_cli.several_values import SeveralValuesCommand

runner = CliRunner()
JSON_ITEM = json.dumps({"name": "c", "path": "/z", "base_model_name": "base"})


def _received(args: list[str]) -> tuple[str | None, list[str]]:
    """What a command built as ``tokenmill serve`` is (a model argument, ``--lora-modules``, a flag) receives."""
    app = typer.Typer()
    got: dict[str, Any] = {}

    @app.command(cls=SeveralValuesCommand)
    def serve(model: Annotated[str | None, typer.Argument()] = None,
              lora_modules: Annotated[list[str] | None, typer.Option()] = None,
              enable_lora: Annotated[bool, typer.Option("--enable-lora")] = False) -> None:
        got.update(model=model, lora_modules=lora_modules or [])

    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return got["model"], got["lora_modules"]


@pytest.mark.parametrize("args", [
    ["base", "--lora-modules", "a=/x", "b=/y", JSON_ITEM, "--enable-lora"],  # one flag, vLLM's form
    ["base", "--lora-modules", "a=/x", "--lora-modules", "b=/y", "--lora-modules", JSON_ITEM],  # repeated
    ["--lora-modules=a=/x", "b=/y", "--enable-lora", "--lora-modules", JSON_ITEM, "base"],  # mixed, model last
])
def test_every_spelling_gives_every_adapter(args):
    assert _received(args) == ("base", ["a=/x", "b=/y", JSON_ITEM])


def test_the_model_argument_after_the_adapters_stays_the_model():
    """After the first value an argument is one more only if it looks like one (name=path, JSON)."""
    assert _received(["--lora-modules", "a=/x", "b=/y", "/models/base"]) == ("/models/base", ["a=/x", "b=/y"])
    assert _received(["--lora-modules", "a=/x", "--", "b=/y"]) == ("b=/y", ["a=/x"])  # after --: positional


@pytest.mark.parametrize(("item", "problem"), [
    ("b=", "lacks a path after the ="),
    ("=/y", "lacks a name before the ="),
    ('{"name": "b"}', "path: Field required"),
    ('{"name": "b", "path": "/y", "rank": 8}', "rank: Extra inputs are not permitted"),
    ('{"name": b}', "is not valid JSON"),
])
def test_a_malformed_item_is_an_error_quoting_it(item, problem):
    """The second item after one flag is read as the first is, and fails with its own message
    (before any model loads)."""
    result = runner.invoke(build_app(), ["serve", "/no/model", "--enable-lora", "--lora-modules", "a=/x", item])
    assert result.exit_code == 2
    assert f"--lora-modules {item!r}" in result.output and problem in result.output, result.output


def test_a_first_item_without_a_name_is_an_error():
    result = runner.invoke(build_app(), ["serve", "/no/model", "--enable-lora", "--lora-modules", "adapter"])
    assert result.exit_code == 2
    assert "--lora-modules 'adapter' lacks an = between name and path" in result.output, result.output
