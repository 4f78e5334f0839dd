"""``tokenmill``: the command-line entry point; each command lives in its own module."""

from __future__ import annotations

import logging

import typer

from tokenmill.config import EngineConfig
from tokenmill_cli import generate, plugins, serve
from tokenmill_cli.bench.app import build_bench_app
from tokenmill_cli.engine_options import MODEL_ARGUMENT, MODEL_OPTION, engine_command
from tokenmill_cli.router.command import router
from tokenmill_cli.several_values import SeveralValuesCommand
from tokenmill_cli.tokenizer import build_tokenizer_app


def build_app(config_cls: type[EngineConfig] = EngineConfig) -> typer.Typer:
    """The ``tokenmill`` app; the commands that start an engine take the options of ``config_cls``'s fields."""
    app = typer.Typer(
        name="tokenmill",
        help="tokenmill: a plugin-first LLM inference and serving engine.",
        no_args_is_help=True,
        pretty_exceptions_enable=False,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    app.command("generate", help="Generate text for one or more prompts with a local engine.")(
        engine_command(generate.generate, config_cls, model=MODEL_OPTION))
    app.command("serve", help="Serve a model over an OpenAI-compatible HTTP API.", cls=SeveralValuesCommand)(
        engine_command(serve.serve, config_cls, model=MODEL_ARGUMENT))
    app.command("router", help="Disaggregated prefill/decode: an OpenAI-compatible front over prefill and decode "
                               "servers.")(router)
    app.add_typer(build_bench_app(config_cls), name="bench",
                  help="Benchmarks: throughput, latency, serve; random-model makes a checkpoint.")
    app.add_typer(build_tokenizer_app(), name="tokenizer", help="A model's tokenizer: export it as a folder.")
    app.command("plugins", help="List installed plugins: name, distribution, version, hooks and what they register.")(
        plugins.list_plugins
    )
    app.callback()(_root)
    return app


def _root(log_level: str = typer.Option("warning", help="debug, info, warning or error")) -> None:
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")


app = build_app()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
