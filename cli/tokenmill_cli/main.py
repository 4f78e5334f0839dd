"""``tokenmill``: the command-line entry point; each command lives in its own module."""

from __future__ import annotations

import logging

import typer

from tokenmill_cli import generate, plugins, serve
from tokenmill_cli.bench.app import bench_app

app = typer.Typer(
    name="tokenmill",
    help="tokenmill: a plugin-first LLM inference and serving engine.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.command("generate", help="Generate text for one or more prompts with a local engine.")(generate.generate)
app.command("serve", help="Serve a model over an OpenAI-compatible HTTP API.")(serve.serve)
app.add_typer(bench_app, name="bench", help="Benchmarks: throughput, latency, serve; random-model makes a checkpoint.")
app.command("plugins", help="List installed plugins: name, distribution, version, hooks and what they register.")(
    plugins.list_plugins
)


@app.callback()
def _root(log_level: str = typer.Option("warning", help="debug, info, warning or error")) -> None:
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
